"""Third-party drivers as pip packages, and the page that tells their authors how to write one.

The example package (examples/widget-driver) is installed with pip into a fresh virtual
environment next to the host and its test kit (testkit/), the way an operator would install a
vendor's driver, and then used through the host's own command line and against the kubelet
simulator. Nothing about the host changes: if this passes, a driver needs nothing but its
entry point.

The project, the kit and the example are built as wheels from copies of their sources: pip builds a
local directory in place, and setuptools would otherwise write build/ and *.egg-info into the
checkout other people (and parallel test runs) are using. Dependencies come from the package
index through pip's cache; set PIP_NO_INDEX=1 and PIP_FIND_LINKS=<wheel dir> to run offline.
"""

from __future__ import annotations

import ast
import asyncio
import importlib.metadata
import inspect
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

import pytest

from host.core import capabilities, model
from host.core.driver import Driver
from host.sim.kubelet import KubeletSimulator
from host.sim.tree import FakeTree

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "widget-driver"
DOC = REPO / "docs" / "drivers.md"
HOOKSPECS = REPO / "host" / "core" / "hookspecs.py"

GAUDI = "habana.ai/gaudi"
ACCEL_MAJOR = 261
CONTROL_MAJOR = 508
#: pip's words for "the index could not be reached", as opposed to a broken package.
_OFFLINE = re.compile(
    r"NewConnectionError|ConnectTimeoutError|Temporary failure in name resolution|"
    r"Network is unreachable|Failed to establish a new connection|ProxyError"
)
_SKIP_COPY = shutil.ignore_patterns(
    "__pycache__", "*.pyc", "build", "dist", "*.egg-info", ".pytest_cache", ".ruff_cache"
)


# -- the environment ---------------------------------------------------------------------------
def _clean_env(**extra: str) -> Dict[str, str]:
    """The test's environment without anything that would let the venv see this checkout."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1", PYTHONDONTWRITEBYTECODE="1")
    env.update(extra)
    return env


def _pip(args: Sequence[str], what: str, cwd: Path,
         installer: Sequence[str] = (sys.executable,)) -> None:
    """Run pip; ``installer`` is the interpreter, then options that go before the command."""
    python, *options = installer
    result = subprocess.run(
        [python, "-m", "pip", *options, *args], capture_output=True, text=True, timeout=600,
        env=_clean_env(), cwd=cwd,
    )
    if result.returncode != 0:
        output = result.stdout + result.stderr
        if _OFFLINE.search(output):
            pytest.skip(f"{what}: no package index reachable (set PIP_NO_INDEX=1 and "
                        f"PIP_FIND_LINKS to a wheel directory to run offline)")
        pytest.fail(f"{what} failed:\n{output[-4000:]}")


def _source_copy(source: Path, target: Path, names: Sequence[str]) -> Path:
    """The files a build needs, copied: top-level files plus the named folders."""
    target.mkdir(parents=True)
    for entry in source.iterdir():
        if entry.is_file():
            shutil.copy2(entry, target / entry.name)
        elif entry.name in names:
            shutil.copytree(entry, target / entry.name, ignore=_SKIP_COPY)
    return target


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv holding the host, its test kit and the widget driver, each installed from
    its wheel."""
    work = tmp_path_factory.mktemp("third-party")
    main = _source_copy(REPO, work / "src" / "device-plugin-host",
                        ("host", "drivers", "device_plugin_host"))
    kit = _source_copy(REPO / "testkit", work / "src" / "testkit",
                       ("device_plugin_host_testing",))
    widget = _source_copy(EXAMPLE, work / "src" / "widget-driver", ("src",))
    wheels = work / "wheels"
    # Without isolation the build reuses this interpreter's setuptools: no download.
    isolation = ["--no-build-isolation"] if _version("setuptools") >= (77,) else []
    _pip(["wheel", "--no-deps", *isolation, "-q", "-w", str(wheels), str(main), str(kit),
          str(widget)],
         "building the wheels", work)
    built = sorted(str(p) for p in wheels.glob("*.whl"))
    assert len(built) == 3, built
    path = work / "venv"
    # pip --python (pip 22.3+) installs into the new venv without bootstrapping a pip in it,
    # which saves most of the venv's creation time; an older pip gets a venv with its own.
    outside = _version("pip") >= (22, 3)
    subprocess.run([sys.executable, "-m", "venv", *(["--without-pip"] if outside else []),
                    str(path)], check=True, env=_clean_env(), timeout=120)
    python = path / "bin" / "python"
    installer = (sys.executable, "--python", str(python)) if outside else (str(python),)
    _pip(["install", "-q", "--prefer-binary", *built, "pytest>=8"],
         "installing into the fresh venv", work, installer)
    return path


def _version(distribution: str) -> Tuple[int, ...]:
    """An installed distribution's version as numbers; () when it is not installed."""
    try:
        text = importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return ()
    return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


def _run_in(venv: Path, *args: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, cwd=cwd,
                          env=_clean_env(PATH=f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}"))


# -- a Gaudi box, written out here rather than with the package's own helpers ------------------
def gaudi_box(root: Path) -> List[str]:
    """Four Gaudi2 cards (habanalabs) on two NUMA nodes, each behind a root port, with their
    accel minors, control nodes and /dev entries as the kernel and udev make them."""
    tree = FakeTree(root)
    tree.numa_nodes(2)
    addresses = []
    for index in range(4):
        numa = index // 2
        root_bus = 0x17 if numa == 0 else 0x97
        bridge = tree.pci_bridge(f"0000:{root_bus:02x}:{index % 2 + 1:02x}.0", numa_node=numa)
        address = f"0000:{root_bus + 2 + index % 2:02x}:00.0"
        function = tree.pci_function(address, vendor=0x1DA3, device=0x1020, pci_class=0x120000,
                                     numa_node=numa, driver="habanalabs", parent=bridge)
        tree.attr(f"{function}/status", "operational")
        tree.attr(f"{function}/device_type", "GAUDI2")
        minor = f"{function}/accel/accel{index}"
        tree.attr(f"{minor}/dev", f"{ACCEL_MAJOR}:{index}")
        tree.attr(f"{minor}/uevent", f"MAJOR={ACCEL_MAJOR}\nMINOR={index}\n"
                                     f"DEVNAME=accel/accel{index}\nDEVTYPE=accel_minor")
        tree.link(f"{minor}/device", function)
        tree.link(f"/sys/class/accel/accel{index}", minor)
        control = f"/sys/devices/virtual/accel/accel_controlD{index}"
        tree.attr(f"{control}/dev", f"{CONTROL_MAJOR}:{index}")
        tree.link(f"/sys/class/accel/accel_controlD{index}", control)
        tree.chardev(f"/dev/accel/accel{index}", ACCEL_MAJOR, index)
        tree.chardev(f"/dev/accel/accel_controlD{index}", CONTROL_MAJOR, index)
        addresses.append(address)
    return addresses


@pytest.fixture
def widget_config(tmp_path: Path) -> Path:
    """A config file naming the widget driver's resource, the way its README says to use it
    (the package has no defaults: the host's built-in accel driver owns the vendors' names),
    and no surprise from an /etc/device-plugin-host/config.toml on the test machine."""
    path = tmp_path / "config.toml"
    path.write_text('[[resource]]\nname = "habana.ai/gaudi"\ndriver = "widget"\n'
                    '[resource.selectors]\nkernel_driver = "habanalabs"\n')
    return path


@pytest.fixture
def builtin_defaults(tmp_path: Path) -> Path:
    """A config file without [[resource]]: every installed driver's defaults."""
    path = tmp_path / "defaults.toml"
    path.write_text("# built-in defaults of every installed driver\n")
    return path


# -- installed and used ------------------------------------------------------------------------
@pytest.mark.slow
def test_discover_in_the_fresh_venv_serves_the_widget_devices(venv, tmp_path, widget_config):
    addresses = gaudi_box(tmp_path / "root")
    result = _run_in(venv, str(venv / "bin" / "device-plugin-host"), "discover", "--config",
                     str(widget_config), "--host-root", str(tmp_path / "root"), "--json",
                     cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "other drivers keep loading" not in result.stderr, result.stderr  # all loaded
    rows = [row for row in json.loads(result.stdout) if row["driver"] == "widget"]
    assert [row["resource"] for row in rows] == [GAUDI] * 4
    assert [row["id"] for row in rows] == addresses
    assert [row["numa_nodes"] for row in rows] == [[0], [0], [1], [1]]
    for index, row in enumerate(rows):
        assert row["health"] == "Healthy", row["health_reason"]
        assert [n["host_path"] for n in row["device_nodes"]] == [
            f"/dev/accel/accel{index}", f"/dev/accel/accel_controlD{index}"]
        assert row["attributes"]["pci_address"] == addresses[index]
        assert row["attributes"]["kernel_driver"] == "habanalabs"
    assert [row for row in json.loads(result.stdout) if row["driver"] != "widget"] == []


@pytest.mark.slow
def test_installing_the_widget_driver_does_not_advertise_the_cards_twice(
    venv, tmp_path, builtin_defaults
):
    addresses = gaudi_box(tmp_path / "root")
    result = _run_in(venv, str(venv / "bin" / "device-plugin-host"), "discover", "--config",
                     str(builtin_defaults), "--host-root", str(tmp_path / "root"), "--json",
                     cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    assert sorted(row["id"] for row in rows) == sorted(addresses)  # each card once
    assert {(row["resource"], row["driver"]) for row in rows} == {(GAUDI, "accel")}


@pytest.mark.slow
def test_the_installed_host_serves_the_widget_resource_to_the_kubelet(
    venv, tmp_path, short_dir, widget_config
):
    addresses = gaudi_box(tmp_path / "root")

    async def scenario() -> None:
        sim = KubeletSimulator(short_dir)
        await sim.start()
        process = await asyncio.create_subprocess_exec(
            str(venv / "bin" / "device-plugin-host"), "run", "--config", str(widget_config),
            "--plugin-dir", short_dir, "--host-root", str(tmp_path / "root"),
            cwd=str(tmp_path), env=_clean_env(), stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT)
        try:
            await sim.wait_for(lambda s: s.resources[GAUDI].allocatable == 4, timeout=30,
                               what="the installed host registered 4 Gaudi cards")
            result = await sim.allocate(GAUDI, 1, pod="infer")
            (device_id,) = result.device_ids
            index = addresses.index(device_id)
            assert sorted(d.host_path for d in result.response.devices) == [
                f"/dev/accel/accel{index}", f"/dev/accel/accel_controlD{index}"]
            assert all(d.container_path == d.host_path and d.permissions == "rw"
                       for d in result.response.devices)
            assert dict(result.response.envs) == {"HABANA_VISIBLE_DEVICES": str(index)}
            process.send_signal(signal.SIGTERM)
            output, _ = await asyncio.wait_for(process.communicate(), 20)
            assert process.returncode == 0, output.decode()
            await sim.wait_for(lambda s: not s.resources[GAUDI].connected,
                               what="the stream ended on SIGTERM")
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
            await sim.stop()

    asyncio.run(asyncio.wait_for(scenario(), 90))


@pytest.mark.slow
def test_the_example_package_own_tests_pass_in_the_fresh_venv(venv, tmp_path):
    # Run from the example's folder: its pyproject is the pytest config, and its src layout
    # means the tests import the installed package, not the files next to them.
    result = _run_in(venv, str(venv / "bin" / "python"), "-m", "pytest", "-q",
                     "-p", "no:cacheprovider", "tests", cwd=EXAMPLE, timeout=300)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert re.search(r"\b\d+ passed\b", result.stdout) and " failed" not in result.stdout


# -- the page for driver authors ---------------------------------------------------------------
def _doc() -> str:
    return DOC.read_text(encoding="utf-8")


def _prose(text: str) -> str:
    """The page without its fenced code blocks, whose "# comment" lines are not headings."""
    return re.sub(r"^```.*?^```[^\n]*$", "", text, flags=re.MULTILINE | re.DOTALL)


def _headings(text: str) -> List[str]:
    return [line for line in _prose(text).splitlines() if re.match(r"#{1,6} ", line)]


def _hook_signatures() -> Dict[str, str]:
    """Each @hookspec function of host/core/hookspecs.py with its signature as written there."""
    tree = ast.parse(HOOKSPECS.read_text(encoding="utf-8"))
    out = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and any(
            (isinstance(d, ast.Name) and d.id == "hookspec")
            or (isinstance(d, ast.Attribute) and d.attr == "hookspec")
            for d in node.decorator_list
        ):
            returns = f" -> {ast.unparse(node.returns)}" if node.returns else ""
            out[node.name] = f"def {node.name}({ast.unparse(node.args)}){returns}"
    return out


def _annotation(value: object) -> str:
    return value if isinstance(value, str) else inspect.formatannotation(value)


def _driver_signatures() -> Dict[str, str]:
    """Each public attribute and method of host.core.driver.Driver, and each method of the optional
    capabilities (host/core/capabilities.py) the class leaves out, as its signature line."""
    out = {}
    for name, annotation in Driver.__annotations__.items():
        if not name.startswith("_"):
            out[name] = f"{name}: {_annotation(annotation)}"
    members = [(name, member) for owner in (Driver, *capabilities.OPTIONAL_CAPABILITIES)
               for name, member in vars(owner).items()]
    for name, member in members:
        if name.startswith("_") or not inspect.isfunction(member) or name in out:
            continue
        params = []
        for param in inspect.signature(member).parameters.values():
            text = param.name
            if param.annotation is not inspect.Parameter.empty:
                text += f": {_annotation(param.annotation)}"
            if param.default is not inspect.Parameter.empty:
                text += f" = {param.default!r}"
            params.append(text)
        returns = inspect.signature(member).return_annotation
        tail = "" if returns is inspect.Signature.empty else f" -> {_annotation(returns)}"
        out[name] = f"def {name}({', '.join(params)}){tail}"
    return out


def test_the_signature_collectors_see_the_whole_api():
    hooks = _hook_signatures()
    assert hooks == {"device_plugin_host_drivers":
                     "def device_plugin_host_drivers() -> Sequence[Driver]"}
    driver = _driver_signatures()
    assert {"name", "subsystems", "selector_types", "setting_types", "discover", "scan",
            "select", "check_selectors", "check_settings", "default_resources", "allocate",
            "preferred", "pre_start", "needs_pre_start"} <= set(driver)
    assert driver["discover"] == ("def discover(self, host: HostFS, resources: "
                                  "Sequence[ResourceConfig]) -> Mapping[str, Sequence[Device]]")


def test_every_hook_and_driver_member_has_its_entry_in_docs_drivers_md():
    text = _doc()
    headings = "\n".join(_headings(text))
    missing = []
    for name, signature in {**_hook_signatures(), **_driver_signatures()}.items():
        if f"`{name}`" not in headings:
            missing.append(f"{name}: no heading with `{name}`")
        if signature not in text:
            missing.append(f"{name}: signature not documented exactly: {signature}")
    assert not missing, "docs/drivers.md is out of date:\n" + "\n".join(missing)


@pytest.mark.parametrize("cls", [model.Device, model.DeviceNode, model.Mount, model.Health,
                                 model.ResourceConfig, model.ContainerAllocation,
                                 model.PreferredRequest])
def test_every_data_type_and_field_is_documented(cls):
    text = _prose(_doc())
    heading = re.search(rf"^(#+) [^\n]*`{cls.__name__}`[^\n]*$", text, re.MULTILINE)
    assert heading, f"docs/drivers.md has no heading for {cls.__name__}"
    if cls is model.Health:
        fields = [member.name for member in model.Health]
    else:
        fields = list(cls.__dataclass_fields__)
    level = len(heading.group(1))
    rest = text[heading.end():]
    end = re.search(rf"^#{{1,{level}}} ", rest, re.MULTILINE)
    section = rest[: end.start()] if end else rest
    missing = [f for f in fields if f"`{f}`" not in section]
    assert not missing, f"docs/drivers.md, {cls.__name__}: fields not described: {missing}"
