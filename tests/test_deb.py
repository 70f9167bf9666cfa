"""The Debian package as an operator meets it: built from this tree by deploy/debian/build_deb.py,
installed into THIS machine's root with dpkg, upgraded over a changed config, removed, purged.

Installing needs root and dpkg (CI runs as root on a throwaway machine). A machine that already
has the package, or files at its paths, is left alone: those tests skip rather than purge
someone's installation. Every install is purged afterwards, also when a test fails, and a file
lock keeps two test runs on one machine from installing at the same time.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, List, Tuple

import pytest

from device_plugin_host_testing.machines import load_machine
from host.cli import EXIT_CONFIG

REPO = Path(__file__).resolve().parents[1]
BUILDER = REPO / "deploy" / "debian" / "build_deb.py"
UNIT_SOURCE = REPO / "deploy" / "systemd" / "device-plugin-host.service"
PACKAGE = "device-plugin-host"
PREFIX = Path("/opt/device-plugin-host")
VENV = PREFIX / "venv"
CONFIG = Path("/etc/device-plugin-host/config.toml")
PROGRAM = Path("/usr/bin/device-plugin-host")
UNIT = Path("/lib/systemd/system/device-plugin-host.service")
WANTS = Path("/etc/systemd/system/multi-user.target.wants/device-plugin-host.service")
MASK = Path("/etc/systemd/system/device-plugin-host.service")
STATE = Path("/var/lib/device-plugin-host")  # the unit's StateDirectory: drain marks
LOCK = Path("/tmp/device-plugin-host-deb-tests.lock")
OPERATOR_CHANGE = '\n# changed by the operator\n[host]\nlog_level = "debug"\n'

needs_dpkg = pytest.mark.skipif(
    shutil.which("dpkg-deb") is None or shutil.which("dpkg") is None,
    reason="dpkg and dpkg-deb not found: building and installing .deb files needs a Debian system",
)
pytestmark = [needs_dpkg, pytest.mark.timeout(900)]


def _project_version() -> str:
    text = (REPO / "pyproject.toml").read_text()
    return re.search(r'^version = "([^"]+)"', text, re.M).group(1)


@dataclass(frozen=True)
class Debs:
    v1: Path
    v2: Path
    v1_config: bytes
    v2_config: bytes


def _build(out: Path, wheelhouse: Path, revision: str, config: Path) -> Path:
    result = subprocess.run(
        [sys.executable, str(BUILDER), "--output", str(out), "--wheelhouse", str(wheelhouse),
         "--revision", revision, "--config", str(config)],
        capture_output=True, text=True, timeout=600, cwd=REPO,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    deb = Path(result.stdout.strip().splitlines()[-1])
    assert deb.is_file() and deb.parent == out
    return deb


@pytest.fixture(scope="session")
def debs(tmp_path_factory: pytest.TempPathFactory) -> Debs:
    """Two builds, revision 1 and 2, the second shipping a different default config; both
    from one wheelhouse, filled once per test session."""
    if shutil.which("dpkg-deb") is None:
        pytest.skip("dpkg-deb not found")
    out = tmp_path_factory.mktemp("debs")
    wheelhouse = out / "wheelhouse"
    v1_config = (REPO / "config" / "config.toml").read_bytes()
    v2_config = v1_config + b"\n# shipped by revision 2: a new default\n"
    (out / "config-v2.toml").write_bytes(v2_config)
    v1 = _build(out, wheelhouse, "1", REPO / "config" / "config.toml")
    v2 = _build(out, wheelhouse, "2", out / "config-v2.toml")
    return Debs(v1, v2, v1_config, v2_config)


# -- the builder's rules (no dpkg needed) ---------------------------------------------------
def _builder():
    """deploy/ is no package: load the script as a module (dataclasses need it registered)."""
    if "build_deb" not in sys.modules:
        spec = importlib.util.spec_from_file_location("build_deb", BUILDER)
        module = importlib.util.module_from_spec(spec)
        sys.modules["build_deb"] = module
        spec.loader.exec_module(module)
    return sys.modules["build_deb"]


@pytest.mark.parametrize(("pep440", "debian"), [
    ("0.1.0", "0.1.0-1"), ("0.2.0rc1", "0.2.0~rc1-1"), ("1.0.dev3", "1.0~dev3-1"),
    ("1.0b2", "1.0~b2-1"), ("1.0.post1", "1.0+post1-1"),
])
def test_pep440_versions_sort_the_same_way_in_debian(pep440: str, debian: str):
    assert _builder().debian_version(pep440, "1") == debian


def test_depends_follow_the_bundled_wheels(tmp_path: Path):
    build = _builder()
    names = [
        "device_plugin_host-0.1.0-py3-none-any.whl",
        "grpcio-1.85.3-cp311-cp311-manylinux2014_x86_64.manylinux_2_17_x86_64.whl",
        "grpcio-1.85.3-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.whl",
        # any one of a wheel's tags will do: its most lenient one counts
        "psutil-7.2.2-cp36-abi3-manylinux2010_x86_64.manylinux_2_12_x86_64."
        "manylinux_2_28_x86_64.whl",
    ]
    wheels = [tmp_path / n for n in names]
    target = build.Target(("3.11", "3.12"), "amd64", "2.31")
    assert build.depends(target, wheels) == (
        "python3 (>= 3.11), python3 (<< 3.13), libc6 (>= 2.17)")
    assert build.is_arch_specific(wheels) and not build.is_arch_specific(wheels[:1])
    assert build.depends(target, wheels[:1]) == "python3 (>= 3.11), python3 (<< 3.13)"
    with pytest.raises(build.BuildError, match="consecutive"):
        build.depends(build.Target(("3.11", "3.13"), "amd64", "2.31"), wheels)
    platforms = build.Target(("3.11",), "arm64", "2.17").platforms
    assert "manylinux_2_17_aarch64" in platforms and "manylinux2014_aarch64" in platforms
    assert "manylinux_2_18_aarch64" not in platforms


# -- the package file ----------------------------------------------------------------------
def _field(deb: Path, name: str) -> str:
    return subprocess.run(["dpkg-deb", "--field", str(deb), name], capture_output=True,
                          text=True, check=True).stdout.strip()


def _contents(deb: Path) -> Dict[str, Tuple[str, str, str]]:
    """path -> (mode, owner, link target) from `dpkg-deb --contents`."""
    listing = subprocess.run(["dpkg-deb", "--contents", str(deb)], capture_output=True,
                             text=True, check=True).stdout
    entries = {}
    for line in listing.splitlines():
        mode, owner, _size, _date, _time, rest = line.split(None, 5)
        path, _, target = rest.partition(" -> ")
        entries[path.lstrip(".").rstrip("/") or "/"] = (mode, owner, target)
    return entries


def _system_python() -> str:
    python = Path("/usr/bin/python3")
    if not python.exists():
        return "{}.{}".format(*sys.version_info[:2])
    return subprocess.run([str(python), "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                          capture_output=True, text=True, check=True).stdout.strip()


@pytest.mark.slow  # builds two .deb files (~30 s): CI runs it, the fast suite does not
def test_package_names_its_version_dependencies_and_conffile(debs: Debs, tmp_path: Path):
    version = _project_version()
    assert _field(debs.v1, "Package") == PACKAGE
    assert _field(debs.v1, "Version") == f"{version}-1"
    assert _field(debs.v2, "Version") == f"{version}-2"
    newer = subprocess.run(["dpkg", "--compare-versions", _field(debs.v2, "Version"), "gt",
                            _field(debs.v1, "Version")])
    assert newer.returncode == 0
    arch = subprocess.run(["dpkg", "--print-architecture"], capture_output=True, text=True,
                          check=True).stdout.strip()
    assert _field(debs.v1, "Architecture") == arch  # grpcio is a binary wheel
    depends = _field(debs.v1, "Depends")
    major, minor = (int(x) for x in _system_python().split("."))
    # The wheels are for this machine's python3 and that is what Depends promises.
    assert f"python3 (>= {major}.{minor})" in depends
    assert f"python3 (<< {major}.{minor + 1})" in depends
    assert re.search(r"libc6 \(>= 2\.\d+\)", depends)
    assert "python3-venv" not in depends and "python3-pip" not in depends

    control = tmp_path / "DEBIAN"
    subprocess.run(["dpkg-deb", "--control", str(debs.v1), str(control)], check=True)
    assert (control / "conffiles").read_text() == f"{CONFIG}\n"
    for script in ("postinst", "prerm", "postrm"):
        path = control / script
        assert path.stat().st_mode & 0o111, f"{script} is not executable"
        text = path.read_text()
        assert text.startswith("#!/bin/sh\n") and not re.search(r"@[A-Z_]+@", text)
        syntax = subprocess.run(["sh", "-n", str(path)], capture_output=True, text=True)
        assert syntax.returncode == 0, f"{script}: {syntax.stderr}"
    md5sums = (control / "md5sums").read_text()
    assert "opt/device-plugin-host/wheels/" in md5sums
    assert "etc/device-plugin-host" not in md5sums  # conffiles are checked by their own hash


@pytest.mark.slow  # builds two .deb files (~30 s): CI runs it, the fast suite does not
def test_package_contents(debs: Debs, tmp_path: Path):
    entries = _contents(debs.v1)
    assert {owner for _, owner, _ in entries.values()} == {"root/root"}
    assert entries[str(PROGRAM)][0].startswith("l")
    assert entries[str(PROGRAM)][2] == f"{VENV}/bin/device-plugin-host"
    assert entries[str(CONFIG)][0] == "-rw-r--r--"
    assert entries[str(UNIT)][0] == "-rw-r--r--"
    wheels = [p.rsplit("/", 1)[1] for p in entries if p.startswith(f"{PREFIX}/wheels/")]
    version = _project_version()
    assert f"device_plugin_host-{version}-py3-none-any.whl" in wheels
    for name in ("grpcio", "protobuf", "pluggy", "pyudev", "psutil", "pip"):
        assert any(w.startswith(name + "-") for w in wheels), f"no {name} wheel in {wheels}"
    assert not any(p.startswith(str(VENV)) for p in entries)  # built by postinst, not shipped

    tree = tmp_path / "tree"
    subprocess.run(["dpkg-deb", "--extract", str(debs.v2), str(tree)], check=True)
    assert (tree / str(CONFIG).lstrip("/")).read_bytes() == debs.v2_config
    assert (tree / str(UNIT).lstrip("/")).read_bytes() == UNIT_SOURCE.read_bytes()
    # the test kit is a distribution of its own: neither bundled nor inside our wheel
    assert not any(w.startswith("device_plugin_host_testing-") for w in wheels)
    ours = (tree / str(PREFIX).lstrip("/") / "wheels"
            / f"device_plugin_host-{version}-py3-none-any.whl")
    with zipfile.ZipFile(ours) as wheel:
        assert not [n for n in wheel.namelist()
                    if n.startswith("device_plugin_host_testing/") or n.endswith(".tree")]


# -- the unit ------------------------------------------------------------------------------
def _unit(path: Path) -> Dict[str, Dict[str, List[str]]]:
    """systemd's format allows a key more than once, which configparser does not."""
    sections: Dict[str, Dict[str, List[str]]] = {}
    current: Dict[str, List[str]] = {}
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
            continue
        key, _, value = line.partition("=")
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def test_unit_is_notify_restarting_hardened_and_independent_of_the_kubelet():
    unit = _unit(UNIT_SOURCE)
    service, section = unit["Service"], unit["Unit"]
    assert service["Type"] == ["notify"] and service["NotifyAccess"] == ["main"]
    assert service["ExecStart"] == [f"{PROGRAM} run --config {CONFIG}"]
    assert service["Restart"] == ["on-failure"]
    # An invalid configuration is not retried: the same exit status the CLI uses for it.
    assert service["RestartPreventExitStatus"] == [str(EXIT_CONFIG)]
    assert service["WatchdogSec"] and service["TimeoutStartSec"] != ["infinity"]
    assert service["ProtectSystem"] == ["strict"]
    writable = [p.lstrip("-") for p in service["ReadWritePaths"]]
    assert "/var/lib/kubelet/device-plugins" in writable and "/run/cdi" in writable
    # Each writable path exists before the sandbox is built (else it would be read-only).
    created = " ".join(service["ExecStartPre"])
    assert all(p in created for p in writable)
    assert all(cmd.startswith("+") for cmd in service["ExecStartPre"])
    for key in ("ProtectHome", "PrivateTmp", "NoNewPrivileges"):
        assert service[key] == ["yes"], key
    # /sys and /dev stay the real ones and the device policy stays open.
    for key in ("PrivateDevices", "ProtectKernelTunables", "DevicePolicy", "DeviceAllow",
                "ProtectClock"):
        assert key not in service, key
    assert not any(k.startswith(("Condition", "Assert")) for k in section)
    for key in ("Requires", "BindsTo", "Wants", "PartOf", "Requisite"):
        assert "kubelet" not in " ".join(section.get(key, [])), key
    assert unit["Install"]["WantedBy"] == ["multi-user.target"]


def test_unit_can_write_the_nfd_feature_file_and_the_device_info_files():
    """ProtectSystem=strict leaves /etc and /run read-only: the default nfd_features_file and
    an sriov resource's device_info files (an Allocate fails when they cannot be written)
    need their directories writable, and existing before the sandbox is built."""
    import posixpath

    from host.config import HostSettings
    from host.outputs.devinfo import DEFAULT_DIR

    service = _unit(UNIT_SOURCE)["Service"]
    writable = [p.lstrip("-") for p in service["ReadWritePaths"]]
    created = " ".join(service["ExecStartPre"])
    for directory in (posixpath.dirname(HostSettings().nfd_features_file),
                      DEFAULT_DIR.replace("/var/run/", "/run/")):
        assert directory in writable, directory
        assert directory in created, directory


def test_unit_lets_localhost_scrape_the_metrics_endpoint():
    """IPAddressDeny=any alone drops every IP packet, loopback included: the README's
    `curl localhost:9400/metrics` could never work under the unit."""
    service = _unit(UNIT_SOURCE)["Service"]
    assert service["IPAddressDeny"] == ["any"]
    allowed = " ".join(service.get("IPAddressAllow", [])).split()
    assert "localhost" in allowed or {"127.0.0.1", "::1"} <= set(allowed)
    assert "any" not in allowed  # still nothing but loopback
    # The default metrics address is on loopback, so it is inside what the unit allows.
    from host.config import HostSettings

    assert HostSettings().metrics_address.startswith("127.0.0.1:")


# -- installing into this machine ----------------------------------------------------------
def _dpkg(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    return subprocess.run(["dpkg", *args], stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, timeout=600, env=env)


def _ok(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 0, f"{result.args}: {result.stdout}{result.stderr}"
    return result.stdout


def _status() -> str:
    """dpkg's abbreviated status: 'ii' installed, 'rc' config files only, '' unknown."""
    result = subprocess.run(["dpkg-query", "--show", "--showformat=${db:Status-Abbrev}", PACKAGE],
                            capture_output=True, text=True)
    return result.stdout.strip() if result.returncode == 0 else ""


def _installed_version() -> str:
    return subprocess.run(["dpkg-query", "--show", "--showformat=${Version}", PACKAGE],
                          capture_output=True, text=True, check=True).stdout


def _clean_env() -> Dict[str, str]:
    """The installed program must not see this checkout (PYTHONPATH, PIP_*)."""
    return {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}


def _run_installed(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(PROGRAM), *args], capture_output=True, text=True, timeout=120,
                          env=_clean_env(), cwd="/")


@pytest.fixture
def system() -> Iterator[None]:
    """This machine's root, free of the package before and after the test."""
    if os.geteuid() != 0:
        pytest.skip("installing a .deb needs root")
    with open(LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _status() not in ("", "un", "pn"):
            pytest.skip(f"{PACKAGE} is already installed here ({_status()}); not touching it")
        for path in (CONFIG.parent, PREFIX, PROGRAM, UNIT):
            if os.path.lexists(path):
                pytest.skip(f"{path} exists but is not ours; not touching it")
        try:
            yield
        finally:
            _dpkg("--purge", PACKAGE)
            if _status() not in ("", "un", "pn"):  # half-installed after a failure
                _dpkg("--purge", "--force-all", PACKAGE)


@pytest.mark.slow
def test_install_runs_the_program_from_its_own_venv(system, debs: Debs, tmp_path: Path):
    _ok(_dpkg("--install", str(debs.v1)))
    assert _status() == "ii"
    version = _project_version()
    assert _ok(_run_installed("--version")).strip() == f"device-plugin-host {version}"
    checked = _run_installed("check-config", str(CONFIG))
    assert checked.returncode == 0 and "valid" in checked.stdout, checked.stderr
    assert CONFIG.read_bytes() == debs.v1_config

    # The venv was built at its final path against this machine's python3, without pip.
    script = (VENV / "bin" / "device-plugin-host").read_text().splitlines()[0]
    assert script == f"#!{VENV}/bin/python"
    assert "home = /usr/bin" in (VENV / "pyvenv.cfg").read_text()
    assert not (VENV / "bin" / "pip").exists()
    where = subprocess.run(
        [str(VENV / "bin" / "python"), "-c", "import host; print(host.__file__)"],
        capture_output=True, text=True, env=_clean_env(), cwd="/", check=True,
    )
    assert where.stdout.startswith(f"{VENV}/lib/")
    _ok(_dpkg("--verify", PACKAGE))

    # The installed drivers (entry points in the venv) find a captured 8-GPU server.
    root = tmp_path / "root"
    load_machine("gpu-server-8x", root)
    config = tmp_path / "gpu.toml"
    config.write_text('[[resource]]\nname = "nvidia.com/gpu"\ndriver = "gpu"\n'
                      '[resource.selectors]\nvendor = "0x10de"\n')
    found = _run_installed("discover", "--config", str(config), "--host-root", str(root), "--json")
    rows = json.loads(_ok(found))
    assert len(rows) == 8 and {r["resource"] for r in rows} == {"nvidia.com/gpu"}

    if shutil.which("deb-systemd-helper"):  # enabled even though systemd is not running here
        assert WANTS.is_symlink() and os.readlink(WANTS) == str(UNIT)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                    reason="systemd-analyze not found (Debian package: systemd)")
def test_installed_unit_passes_systemd_analyze_verify(system, debs: Debs):
    _ok(_dpkg("--install", str(debs.v1)))
    result = subprocess.run(["systemd-analyze", "verify", str(UNIT)], capture_output=True,
                            text=True, timeout=120)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "device-plugin-host" not in output, output  # no warning about our unit either


@pytest.mark.slow
def test_upgrade_with_an_untouched_config_takes_the_new_default(system, debs: Debs):
    _ok(_dpkg("--install", str(debs.v1)))
    _ok(_dpkg("--install", str(debs.v2)))  # no --force-conf*: nothing to ask about
    assert _installed_version().endswith("-2")
    assert CONFIG.read_bytes() == debs.v2_config
    assert sorted(p.name for p in CONFIG.parent.iterdir()) == ["config.toml"]


@pytest.mark.slow
def test_upgrade_remove_reinstall_purge_keep_then_drop_the_operator_config(system, debs: Debs):
    _ok(_dpkg("--install", str(debs.v1)))
    CONFIG.write_bytes(debs.v1_config + OPERATOR_CHANGE.encode())
    marker = VENV / "built-by-revision-1"
    marker.touch()

    # Upgrade: the operator's file stays, the new default lands beside it as .dpkg-dist.
    _ok(_dpkg("--install", "--force-confold", str(debs.v2)))
    assert _status() == "ii" and _installed_version().endswith("-2")
    assert CONFIG.read_bytes() == debs.v1_config + OPERATOR_CHANGE.encode()
    assert Path(f"{CONFIG}.dpkg-dist").read_bytes() == debs.v2_config
    assert not marker.exists()  # the venv was rebuilt from the new package's wheels
    checked = _run_installed("check-config", str(CONFIG))
    assert checked.returncode == 0, checked.stderr

    # Remove: the program, the venv and the unit go; the config and the enablement stay.
    _ok(_dpkg("--remove", PACKAGE))
    assert _status() == "rc"
    assert CONFIG.read_bytes() == debs.v1_config + OPERATOR_CHANGE.encode()
    for gone in (PROGRAM, PREFIX, UNIT):
        assert not os.path.lexists(gone), gone
    helper = shutil.which("deb-systemd-helper") is not None
    if helper:
        assert WANTS.is_symlink()

    # Reinstall: the kept config is used as it is, and the unit is enabled, not masked.
    _ok(_dpkg("--install", str(debs.v2)))
    assert CONFIG.read_bytes() == debs.v1_config + OPERATOR_CHANGE.encode()
    assert _ok(_run_installed("--version")).startswith("device-plugin-host ")
    if helper:
        assert WANTS.is_symlink() and not os.path.lexists(MASK)

    # Purge: nothing of ours is left.
    _ok(_dpkg("--purge", PACKAGE))
    assert _status() in ("", "un", "pn")
    for gone in (CONFIG.parent, PREFIX, PROGRAM, UNIT, WANTS, MASK):
        assert not os.path.lexists(gone), gone


@pytest.fixture
def state_dir() -> Iterator[None]:
    """/var/lib/device-plugin-host free of anyone's marks. An empty one (a host run by other
    tests creates it for its drain watch) is put back as it was afterwards."""
    existed = STATE.is_dir() and not STATE.is_symlink()
    if os.path.lexists(STATE) and not existed:
        pytest.skip(f"{STATE} exists and is not a directory; not touching it")
    if existed and any(STATE.iterdir()):
        pytest.skip(f"{STATE} holds files that are not ours; not touching it")
    try:
        yield
    finally:  # what the test wrote goes, also when a purge failed to remove it
        if STATE.is_dir() and not STATE.is_symlink():
            shutil.rmtree(STATE)
        if existed:
            STATE.mkdir(mode=0o700)


@pytest.mark.slow
def test_remove_keeps_and_purge_deletes_the_drain_marks(state_dir, system, debs: Debs):
    _ok(_dpkg("--install", str(debs.v1)))
    _ok(_run_installed("drain", "nvidia.com/gpu", "0000:18:00.0", "--reason", "bad ECC"))
    marks = STATE / "drained"
    assert marks.is_file()
    _ok(_dpkg("--remove", PACKAGE))
    assert marks.is_file(), "apt remove must keep the operator's drain marks"
    _ok(_dpkg("--purge", PACKAGE))
    assert not os.path.lexists(STATE), "apt purge must delete /var/lib/device-plugin-host"
