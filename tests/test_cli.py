"""The command line as operators use it: real processes, real entry points, real signals."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from device_plugin_host_testing.machines import MACHINES, load_machine
from host.sim import fake_gpu
from host.sim.kubelet import KubeletSimulator
from host.sim.tree import FakeTree

REPO = Path(__file__).resolve().parents[1]


def _cli(*args: str, env_extra=None, timeout: float = 60) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), *(env_extra or {}).pop(
        "PYTHONPATH", "").split(os.pathsep)])) if env_extra else str(REPO)
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "host", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=REPO)


def _gpu_tree(root: Path) -> FakeTree:
    tree = FakeTree(root)
    tree.numa_nodes(2)
    fake_gpu.add_nvidia_control_nodes(tree)
    fake_gpu.add_nvidia_gpu(tree, "0000:18:00.0", minor=0, numa_node=0)
    fake_gpu.add_nvidia_gpu(tree, "0000:86:00.0", minor=1, numa_node=-1)
    return tree


def _private_config(tmp_path: Path) -> Path:
    """A config file whose drain marks live under tmp_path: a host run by a test must not
    create the real /var/lib/device-plugin-host (it watches its drain file's directory)."""
    config = tmp_path / "private.toml"
    config.write_text(f'[host]\ndrain_file = "{tmp_path / "state" / "drained"}"\n')
    return config


def test_discover_json_has_the_documented_keys(tmp_path):
    _gpu_tree(tmp_path / "root")
    result = _cli("discover", "--host-root", str(tmp_path / "root"), "--json")
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    assert [r["id"] for r in rows] == ["0000:18:00.0", "0000:86:00.0"]
    keys = {"resource", "id", "health", "numa_nodes", "device_nodes", "mounts", "env",
            "annotations", "cdi_devices", "driver", "attributes"}
    for row in rows:
        assert keys <= set(row)
        assert row["resource"] == "nvidia.com/gpu" and row["driver"] == "gpu"
        assert row["attributes"]["pci_address"] == row["id"]
        for node in row["device_nodes"]:
            assert set(node) == {"host_path", "container_path", "permissions"}
            assert not node["host_path"].startswith(str(tmp_path))  # host paths, no prefix
    assert rows[0]["numa_nodes"] == [0] and rows[1]["numa_nodes"] == []


def test_discover_table_on_the_8_gpu_server(tmp_path):
    load_machine("gpu-server-8x", tmp_path / "root")
    result = _cli("discover", "--host-root", str(tmp_path / "root"))
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stdout.splitlines() if line.startswith("nvidia.com/gpu")]
    assert len(lines) == 8
    assert all(" Healthy " in line for line in lines)
    assert sum(1 for line in lines if " 0 " in line) == 4


def test_discover_on_this_machine_says_nothing_to_serve_rather_than_failing():
    result = _cli("discover")
    assert result.returncode == 0, result.stderr
    if "nothing to serve" not in result.stderr:  # a machine with real devices
        assert result.stdout.strip()


def test_invalid_config_exits_2_naming_file_key_and_reason(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[[resource]]\nname = "Example.com/gpu"\ndriver = "gpu"\n')
    result = _cli("run", "--config", str(bad), "--plugin-dir", str(tmp_path))
    assert result.returncode == 2
    assert str(bad) in result.stderr and "resource[0]" in result.stderr
    assert "lowercase" in result.stderr
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".sock")]  # nothing served
    check = _cli("check-config", str(bad))
    assert check.returncode == 2 and "Example.com/gpu" in check.stderr


def test_check_config_accepts_the_shipped_config():
    result = _cli("check-config", str(REPO / "config" / "config.toml"))
    assert result.returncode == 0, result.stderr
    assert "valid" in result.stdout


def test_demo_runs_end_to_end():
    result = _cli("demo")
    assert result.returncode == 0, result.stderr
    assert "registered" in result.stdout and "Allocate" in result.stdout
    assert "/dev/nvidia" in result.stdout
    # a new user's first command says nothing alarming: no warning, no error, no traceback
    noise = [line for line in (result.stdout + result.stderr).splitlines()
             if any(word in line for word in ("WARNING", "ERROR", "Traceback"))]
    assert noise == []


def test_demo_runs_with_a_temp_dir_too_long_for_socket_paths(tmp_path):
    """A long TMPDIR (pytest's own, a CI runner's) made the demo's plugin directory fail the
    socket-path limit with a config error: the README's first command must still work."""
    long_tmp = tmp_path / ("t" * 40)
    long_tmp.mkdir()
    result = _cli("demo", env_extra={"TMPDIR": str(long_tmp)})
    assert result.returncode == 0, result.stderr
    assert "registered" in result.stdout
    assert list(long_tmp.iterdir()) == []


def test_broken_third_party_package_is_logged_and_the_rest_load(tmp_path):
    site = tmp_path / "site"
    dist = site / "brokendrv-1.2.3.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: brokendrv\nVersion: 1.2.3\n")
    (dist / "entry_points.txt").write_text(
        "[device_plugin_host.drivers]\nbroken = brokendrv_mod\nmissing = no_such_module_xyz\n")
    (site / "brokendrv_mod.py").write_text("raise RuntimeError('boom at import')\n")
    good = site / "gooddrv-0.4.dist-info"
    good.mkdir()
    (good / "METADATA").write_text("Metadata-Version: 2.1\nName: gooddrv\nVersion: 0.4\n")
    (good / "entry_points.txt").write_text("[device_plugin_host.drivers]\nwidget = gooddrv_mod\n")
    (site / "gooddrv_mod.py").write_text(textwrap.dedent("""
        from host.core.driver import Driver
        from host.core.hookspecs import hookimpl
        from host.core.model import Device, ResourceConfig

        class Widget(Driver):
            name = "widget"
            def scan(self, host):
                return [Device(id="w0")]
            def select(self, inventory, resource):
                return inventory
            def default_resources(self):
                return [ResourceConfig("example.com/widget", "widget")]

        @hookimpl
        def device_plugin_host_drivers():
            return [Widget()]
    """))
    _gpu_tree(tmp_path / "root")
    result = _cli("discover", "--host-root", str(tmp_path / "root"), "--json",
                  env_extra={"PYTHONPATH": str(site)})
    assert result.returncode == 0, result.stderr
    assert "brokendrv 1.2.3" in result.stderr and "boom at import" in result.stderr
    assert "no_such_module_xyz" in result.stderr
    resources = {row["resource"] for row in json.loads(result.stdout)}
    assert resources == {"nvidia.com/gpu", "example.com/widget"}


def test_sigterm_stops_serving_removes_sockets_and_exits_0(tmp_path, short_dir):
    _gpu_tree(tmp_path / "root")

    async def scenario():
        sim = KubeletSimulator(short_dir)
        await sim.start()
        env = dict(os.environ, PYTHONPATH=str(REPO))
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "host", "run", "--plugin-dir", short_dir,
            "--host-root", str(tmp_path / "root"), "--config", str(_private_config(tmp_path)),
            env=env, cwd=str(REPO),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        try:
            await sim.wait_for(lambda s: "nvidia.com/gpu" in s.resources
                               and s.resources["nvidia.com/gpu"].connected, timeout=20,
                               what="the host process registered")
            assert [n for n in os.listdir(short_dir) if n.startswith("dph-")]
            process.send_signal(signal.SIGTERM)
            output, _ = await asyncio.wait_for(process.communicate(), 15)
            assert process.returncode == 0, output.decode()
            assert not [n for n in os.listdir(short_dir) if n.startswith("dph-")]
            await sim.wait_for(lambda s: not s.resources["nvidia.com/gpu"].connected)
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
            await sim.stop()

    asyncio.run(scenario())


@pytest.mark.parametrize("signum", [signal.SIGINT])
def test_sigint_also_exits_cleanly(tmp_path, short_dir, signum):
    _gpu_tree(tmp_path / "root")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    process = subprocess.Popen(
        [sys.executable, "-m", "host", "run", "--plugin-dir", short_dir, "--host-root",
         str(tmp_path / "root"), "--config", str(_private_config(tmp_path))], env=env, cwd=REPO,
        stderr=subprocess.PIPE, text=True)
    try:
        # No kubelet here: the host serves and waits; it must still stop cleanly.
        deadline = 20
        import time

        start = time.monotonic()
        while not [n for n in os.listdir(short_dir) if n.startswith("dph-")]:
            assert time.monotonic() - start < deadline, "host never served"
            time.sleep(0.05)
        process.send_signal(signum)
        _, err = process.communicate(timeout=15)
        assert process.returncode == 0, err
        assert not [n for n in os.listdir(short_dir) if n.startswith("dph-")]
    finally:
        if process.poll() is None:
            process.kill()


@pytest.mark.parametrize(("machine", "example", "expected"), [
    ("gpu-server-8x", "gpu-server", {"nvidia.com/gpu": 8}),
    ("sriov-network-node", "sriov-node", {"intel.com/intel_sriov_netdevice": 4,
                                          "intel.com/intel_sriov_dpdk": 4,
                                          "nvidia.com/cx6dx_vf": 4,
                                          "rdma/hca_shared_devices_a": 100}),
    ("edge-box", "edge-usb", {"google.com/coral-tpu": 1, "example.com/zigbee": 1,
                              "example.com/plc-line3": 1, "example.com/licence-key": 4,
                              "example.com/camera": 1}),
    ("fpga-node", "fpga-node", {"fpga.intel.com/arria10.dcp1.2-nlb0": 1,
                                "xilinx.com/fpga-u250": 1}),
    ("gaudi-node", "gaudi-node", {"habana.ai/gaudi": 8}),
    ("gaudi3-node", "gaudi3-node", {"habana.ai/gaudi": 8}),
    ("npu-laptop", "npu-laptop", {"npu.intel.com/accel": 1, "gpu.intel.com/i915": 1}),
    ("trainium-node", "trainium-node", {"aws.amazon.com/neuron": 16}),
    ("edge-npu-box", "edge-npu", {"hailo.ai/npu": 1, "gpu.intel.com/i915": 1}),
    ("vgpu-node", "vgpu-node", {"nvidia.com/NVIDIA_L40S-24Q": 4}),
])
def test_discover_each_captured_machine_with_its_example_config(machine, example, expected):
    """What each machine serves, counted from its golden
    (testkit/device_plugin_host_testing/machines/ <m>.discover.json): tests/test_machine_goldens.py
    runs discover (table and --json) on every tree and requires exactly the golden, so these counts
    hold for the live output too."""
    golden = json.loads((MACHINES / f"{machine}.discover.json")
                        .read_text(encoding="utf-8"))
    assert golden["config"] == f"config/examples/{example}.toml"
    counts = {}
    for row in golden["devices"]:
        counts[row["resource"]] = counts.get(row["resource"], 0) + 1
        assert row["health"] == "Healthy", row
    assert counts == expected


# -- operator errors: one line and an exit code, never a traceback ---------------------------
def _one_line_error(result: subprocess.CompletedProcess, code: int) -> str:
    assert result.returncode == code, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


def test_capture_into_a_missing_directory_is_one_line_and_exit_1(tmp_path):
    target = tmp_path / "missing" / "dir" / "x.tree"
    line = _one_line_error(_cli("capture", "-o", str(target)), 1)
    assert str(target) in line and "No such file or directory" in line
    assert not (tmp_path / "missing").exists()


def test_capture_leaves_no_partial_file_beside_the_target(tmp_path):
    load_machine("edge-box", tmp_path / "root")
    target = tmp_path / "out" / "edge.tree"
    target.parent.mkdir()
    result = _cli("capture", "--host-root", str(tmp_path / "root"), "-o", str(target))
    assert result.returncode == 0, result.stderr
    assert target.read_text().startswith("# captured by device-plugin-host capture")
    assert os.listdir(target.parent) == ["edge.tree"]


def test_capture_into_a_closed_pipe_exits_quietly(tmp_path):
    """`capture | head -1`: the reader leaves after one line of ~130 kB (more than a pipe
    holds), so the writer meets EPIPE while printing, or at its final flush."""
    load_machine("gpu-server-8x", tmp_path / "root")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    process = subprocess.Popen(
        [sys.executable, "-m", "host", "capture", "--host-root", str(tmp_path / "root")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=REPO)
    try:
        assert process.stdout.readline().startswith(b"# captured")
        process.stdout.close()
        _, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 1
    assert b"Traceback" not in err and b"BrokenPipe" not in err, err.decode()


def test_debug_shows_the_traceback_that_is_otherwise_hidden(tmp_path):
    target = str(tmp_path / "missing" / "x.tree")
    for argv in (("--debug", "capture", "-o", target), ("capture", "--debug", "-o", target)):
        result = _cli(*argv)
        assert result.returncode == 1
        assert "Traceback" in result.stderr and "No such file or directory" in result.stderr


# -- a host root that cannot be one ----------------------------------------------------------
def _bad_roots(tmp_path: Path):
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "no-sys" / "dev").mkdir(parents=True)
    return [(tmp_path / "missing", "does not exist"), (tmp_path / "a-file", "not a directory"),
            (tmp_path / "no-sys", "no sys/")]


@pytest.mark.parametrize("command", ["discover", "capture", "run"])
def test_a_host_root_without_sys_is_exit_2_not_no_devices(tmp_path, short_dir, command):
    for root, reason in _bad_roots(tmp_path):
        argv = [command, "--host-root", str(root)]
        if command == "run":
            argv += ["--plugin-dir", short_dir]
        line = _one_line_error(_cli(*argv, timeout=30), 2)
        assert "--host-root" in line and str(root) in line and reason in line, line
        assert "nothing to serve" not in line
    assert not [n for n in os.listdir(short_dir) if n.startswith("dph-")]  # run served nothing


def test_a_host_root_from_the_config_file_names_file_and_key(tmp_path, short_dir):
    config = tmp_path / "config.toml"
    config.write_text(f'[host]\nhost_root = "{tmp_path / "nowhere"}"\n')
    for command in ("discover", "run"):
        argv = [command, "--config", str(config)]
        if command == "run":
            argv += ["--plugin-dir", short_dir]
        line = _one_line_error(_cli(*argv, timeout=30), 2)
        assert f"{config}: host.host_root: {tmp_path / 'nowhere'} does not exist" in line, line


# -- discover lists every resource, with why it has no devices -------------------------------
def test_discover_lists_resources_without_devices_and_why(tmp_path):
    _gpu_tree(tmp_path / "root")
    site = tmp_path / "site"
    dist = site / "brokendrv-1.2.3.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: brokendrv\nVersion: 1.2.3\n")
    (dist / "entry_points.txt").write_text("[device_plugin_host.drivers]\nbroken = brokendrv_m\n")
    (site / "brokendrv_m.py").write_text("raise RuntimeError('boom at import')\n")
    config = tmp_path / "config.toml"
    config.write_text(textwrap.dedent("""
        [[resource]]
        name = "nvidia.com/gpu"
        driver = "gpu"
        selectors = { vendor = "0x10de" }
        [[resource]]
        name = "example.com/wrong-vendor"
        driver = "gpu"
        selectors = { vendor = "0x1234" }
        [[resource]]
        name = "example.com/serial"
        driver = "usb"
        [[resource]]
        name = "example.com/broken"
        driver = "broken"
    """))
    argv = ("discover", "--host-root", str(tmp_path / "root"), "--config", str(config))
    extra = {"PYTHONPATH": str(site)}
    table = _cli(*argv, env_extra=dict(extra))
    assert table.returncode == 0, table.stderr
    out = table.stdout
    assert f"the 4 resources configured in {config}" in out
    assert "  nvidia.com/gpu: 2 devices (2 Healthy)" in out
    assert ('  example.com/wrong-vendor: 0 devices: no match for its selectors (vendor="0x1234");'
            " the gpu driver sees 2 devices without them") in out
    assert f"  example.com/serial: 0 devices: the usb driver found no devices under " \
           f"{tmp_path / 'root'}" in out
    broken = [line for line in out.splitlines() if line.startswith("  example.com/broken:")]
    assert broken and "0 devices: the driver failed" in broken[0] and "boom at import" in broken[0]
    # --json keeps stdout the array of devices; the resources without any are told on stderr.
    as_json = _cli(*argv, "--json", env_extra=dict(extra))
    assert [r["resource"] for r in json.loads(as_json.stdout)] == ["nvidia.com/gpu"] * 2
    assert "example.com/wrong-vendor: 0 devices: no match for its selectors" in as_json.stderr
    assert "example.com/serial: 0 devices" in as_json.stderr


def test_discover_without_a_config_file_says_built_in_defaults(tmp_path):
    if os.path.lexists("/etc/device-plugin-host/config.toml"):
        pytest.skip("this machine has a config file at the default path")
    (tmp_path / "root" / "sys").mkdir(parents=True)
    result = _cli("discover", "--host-root", str(tmp_path / "root"))
    assert result.returncode == 0, result.stderr
    assert "built-in defaults (no config file at /etc/device-plugin-host/config.toml)" in \
        result.stdout
    assert "configured" not in result.stdout + result.stderr
    assert "nothing to serve" in result.stderr and "for the built-in defaults" in result.stderr
    assert "  amd.com/gpu: 0 devices: the gpu driver found no devices under" in result.stdout
    assert "(a built-in default: registers once it has a device)" in result.stdout


def test_discover_of_a_file_without_resources_says_built_in_defaults(tmp_path):
    _gpu_tree(tmp_path / "root")
    config = tmp_path / "only-host.toml"
    config.write_text('[host]\nlog_level = "debug"\n')
    result = _cli("discover", "--host-root", str(tmp_path / "root"), "--config", str(config))
    assert result.returncode == 0, result.stderr
    assert f"the built-in defaults ({config} has no [[resource]])" in result.stdout
    assert "  nvidia.com/gpu: 2 devices (2 Healthy)" in result.stdout


# -- drain / undrain: checked keys, honest answers, clear failures ---------------------------
def _drain_cli(config: Path, *args: str) -> subprocess.CompletedProcess:
    return _cli(*args, "--config", str(config))


def _drain_config(tmp_path: Path, drain_file: Path) -> Path:
    config = tmp_path / "c.toml"
    config.write_text(f'[host]\ndrain_file = "{drain_file}"\n')
    return config


@pytest.mark.parametrize(("resource", "device", "words"), [
    ("Example.com/GPU", "0000:18:00.0", "not a valid resource name"),
    ("nvidia.com/gpu\nfoo", "0000:18:00.0", "not a valid resource name"),
    ("nvidia.com/gpu", "0000:18:00.0 extra", "whitespace or control"),
    ("nvidia.com/gpu", "0000:18\t00.0", "whitespace or control"),
    ("nvidia.com/gpu", "", "empty"),
])
@pytest.mark.parametrize("command", ["drain", "undrain"])
def test_drain_refuses_names_and_ids_that_cannot_match(tmp_path, command, resource, device,
                                                       words):
    drain_file = tmp_path / "state" / "drained"
    line = _one_line_error(
        _drain_cli(_drain_config(tmp_path, drain_file), command, resource, device), 2)
    assert words in line
    assert not drain_file.exists()


def test_undrain_of_a_missing_mark_says_so_and_exits_1(tmp_path):
    drain_file = tmp_path / "state" / "drained"
    config = _drain_config(tmp_path, drain_file)
    assert _drain_cli(config, "drain", "nvidia.com/gpu", "0000:18:00.0").returncode == 0
    before = drain_file.read_bytes()
    line = _one_line_error(_drain_cli(config, "undrain", "nvidia.com/gpu", "0000:86:00.0"), 1)
    assert "nvidia.com/gpu 0000:86:00.0 has no drain mark" in line and str(drain_file) in line
    assert drain_file.read_bytes() == before


def test_drain_of_a_resource_this_config_does_not_serve_warns(tmp_path):
    config = _drain_config(tmp_path, tmp_path / "state" / "drained")
    result = _drain_cli(config, "drain", "example.com/typo", "x1")
    assert result.returncode == 0, result.stderr
    assert "example.com/typo is not among the built-in defaults" in result.stderr


def test_drain_into_a_state_directory_that_is_a_file(tmp_path):
    (tmp_path / "state").write_text("")
    config = _drain_config(tmp_path, tmp_path / "state" / "drained")
    line = _one_line_error(_drain_cli(config, "drain", "nvidia.com/gpu", "0000:18:00.0"), 1)
    assert "cannot write the drain marks in" in line and "is not a directory" in line


def _in_private_mount(script: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """A shell script in a mount namespace of its own: whatever it mounts vanishes with it."""
    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("needs root and unshare(1) for a private tmpfs")
    env = dict(os.environ, PYTHONPATH=str(REPO), PY=sys.executable)
    probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "true"],
                           capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"no mount namespaces here: {probe.stderr.decode().strip()}")
    return subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-ec",
                           script], capture_output=True, text=True, env=env, cwd=REPO,
                          timeout=timeout)


def test_drain_on_a_full_state_directory_keeps_the_old_marks(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    config = _drain_config(tmp_path, state / "drained")
    result = _in_private_mount(f"""
        mount -t tmpfs -o size=16k,mode=0700 tmpfs {state}
        "$PY" -m host drain nvidia.com/gpu 0000:18:00.0 --reason first --config {config}
        cp {state}/drained {tmp_path}/before
        dd if=/dev/zero of={state}/fill bs=1k count=64 2>/dev/null || true
        rc=0; "$PY" -m host drain nvidia.com/gpu 0000:86:00.0 --reason "$(head -c 900 \
            /dev/zero | tr '\\0' x)" --config {config} 2>{tmp_path}/err || rc=$?
        echo "rc=$rc"
        cmp {state}/drained {tmp_path}/before && echo same
        ls -A {state}
    """)
    assert result.returncode == 0, result.stderr
    err = (tmp_path / "err").read_text()
    assert "rc=1" in result.stdout and "same" in result.stdout, (result.stdout, err)
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert "cannot write the drain marks" in err and "No space left on device" in err
    assert sorted(result.stdout.split("same")[1].split()) == [".drain.lock", "drained", "fill"]


def test_drain_on_a_read_only_state_directory(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    config = _drain_config(tmp_path, state / "drained")
    result = _in_private_mount(f"""
        mount -t tmpfs -o ro,mode=0700 tmpfs {state}
        rc=0; "$PY" -m host drain nvidia.com/gpu 0000:18:00.0 --config {config} \
            2>{tmp_path}/err || rc=$?
        echo "rc=$rc"
    """)
    assert result.returncode == 0, result.stderr
    err = (tmp_path / "err").read_text()
    assert "rc=1" in result.stdout, (result.stdout, err)
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert "Read-only file system" in err


def test_every_command_and_argument_has_help_text():
    import argparse

    from host.cli import _parser

    parser = _parser()
    pending = [("device-plugin-host", parser)]
    seen = []
    while pending:
        name, current = pending.pop()
        assert current.description, f"{name} has no description"
        for action in current._actions:
            if isinstance(action, argparse._SubParsersAction):
                helped = {choice.dest for choice in action._choices_actions if choice.help}
                assert helped == set(action.choices), f"{name}: commands without help"
                pending += [(f"{name} {c}", p) for c, p in action.choices.items()]
            assert action.help and action.help != argparse.SUPPRESS, \
                f"{name}: {action.option_strings or action.dest} has no help"
        seen.append(name)
    assert len(seen) == 9  # the program and its 8 commands
    for command in ("run", "discover", "check-config", "demo", "drain", "undrain", "pods",
                    "capture"):
        result = _cli(command, "--help")
        assert result.returncode == 0 and "--debug" in result.stdout, result.stderr


@pytest.mark.parametrize(("argv", "code"), [
    (("check-config", "/nonexistent/config.toml"), 2),
    (("discover", "--config", "/nonexistent/config.toml"), 2),
    (("discover", "--host-root", "/nonexistent"), 2),
    (("capture", "--host-root", "/nonexistent"), 2),
    (("capture", "-o", "/proc/no/such/dir/x.tree"), 1),
    (("pods", "--socket", "/nonexistent/pod-resources/kubelet.sock"), 1),
    (("drain", "Bad/Name", "x1"), 2),
    (("drain", "example.com/x"), 2),
    (("drain", "example.com/x", "x1", "--reason", "r" * 2000), 2),
])
def test_operator_errors_are_one_line_with_exit_1_or_2(tmp_path, argv, code):
    if argv[0] in ("drain", "undrain"):
        argv = (*argv, "--config", str(_private_config(tmp_path)))
    line = _one_line_error(_cli(*argv), code)
    assert line.startswith("device-plugin-host"), line


@pytest.mark.parametrize("argv", [
    ["run", "--config", "c.toml", "--plugin-dir", "/p", "--host-root", "/r", "--debug"],
    ["--debug", "run"], ["discover", "--json"], ["check-config", "f.toml", "--host-root", "/r"],
    ["demo", "--keep"], ["drain", "nvidia.com/gpu", "0000:18:00.0", "--reason", "bad"],
    ["drain", "--list"], ["undrain", "a.b/c", "d"], ["pods", "--json", "--claims"],
    ["capture", "-o", "x.tree"],
])
def test_a_command_parses_the_same_with_only_its_own_parser(argv):
    """main() builds only the named command's parser (start-up): what it parses
    must be what the whole command line parses."""
    from host.cli import _command_of, _parser

    assert _command_of(argv) == next(w for w in argv if w != "--debug")
    assert vars(_parser(_command_of(argv)).parse_args(argv)) == vars(_parser().parse_args(argv))
    for needs_all in (["--help"], ["--version"], ["bogus"], [], ["--debug", "--help", "run"]):
        assert _command_of(needs_all) is None
