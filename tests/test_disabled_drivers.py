"""``[host] disabled_drivers``: an installed driver package the operator blocks is never
imported, and discover/check-config say so (the config loader refuses a resource of one and
serves none of its defaults: tests/test_config_keys.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from host.config.plugins import DISABLED_REASON, disabled_in_config, load_drivers

REPO = Path(__file__).resolve().parents[1]


def _python(code: str, *paths: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), *map(str, paths)]))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, env=env, cwd=REPO)


def _probe_package(site: Path, *, broken: bool = False) -> None:
    """A driver distribution as pip leaves it: metadata with entry_points.txt, one module."""
    meta = site / "dph_probe-0.1.dist-info"
    meta.mkdir(parents=True)
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: dph-probe\nVersion: 0.1\n")
    (meta / "entry_points.txt").write_text("[device_plugin_host.drivers]\nprobe = dph_probe\n")
    (site / "dph_probe.py").write_text(textwrap.dedent("""
        import os
        if os.environ.get("PROBE_BREAKS"):
            raise SystemExit("importing the probe package stops the host")
        from device_plugin_host import Driver, hookimpl

        class Probe(Driver):
            name = "probe"
            def scan(self, host):
                return []

        @hookimpl
        def device_plugin_host_drivers():
            return [Probe()]
    """))


def test_a_disabled_built_in_driver_is_not_imported():
    done = _python(
        "import json, sys\n"
        "from host.config.plugins import load_drivers\n"
        "registry = load_drivers(disabled=['gpu'])\n"
        "print(json.dumps([sorted(registry.drivers), sorted(registry.with_unavailable()),\n"
        "                  'drivers.gpu' in sys.modules, 'drivers.usb' in sys.modules,\n"
        "                  registry.disabled_lines()]))")
    assert done.returncode == 0, done.stderr
    names, configurable, gpu_imported, usb_imported, lines = json.loads(done.stdout)
    assert "gpu" not in names and "usb" in names and "gpu" not in configurable
    assert gpu_imported is False and usb_imported is True
    assert len(lines) == 1 and lines[0].startswith("driver gpu: entry point gpu (")
    assert DISABLED_REASON in lines[0]


def test_a_package_is_disabled_before_its_import_can_fail(tmp_path):
    _probe_package(tmp_path)
    env = "import os\nos.environ['PROBE_BREAKS'] = '1'\n"
    done = _python(env + "from host.config.plugins import load_drivers\n"
                   "registry = load_drivers(disabled=['probe'])\n"
                   "assert 'probe' not in registry.drivers and not registry.failures\n"
                   "print(registry.disabled_lines())", tmp_path)
    assert done.returncode == 0, done.stderr
    assert "entry point probe (dph-probe 0.1)" in done.stdout
    # Not disabled, the same package is imported (and here stops the host on import).
    done = _python(env + "from host.config.plugins import load_drivers\nload_drivers()", tmp_path)
    assert "importing the probe package stops the host" in done.stderr


def test_without_the_setting_every_driver_loads():
    registry = load_drivers()
    assert {"gpu", "usb", "sriov", "fpga", "rdma"} <= set(registry.drivers)
    assert registry.disabled == {} and registry.disabled_lines() == []


def test_the_setting_is_read_before_the_drivers_and_only_when_well_formed(tmp_path):
    good = tmp_path / "good.toml"
    good.write_text('[host]\ndisabled_drivers = ["gpu", "dph-widget"]\n')
    assert disabled_in_config(str(good), "/nonexistent") == ("gpu", "dph-widget")
    assert disabled_in_config(None, str(good)) == ("gpu", "dph-widget")
    assert disabled_in_config(None, str(tmp_path / "none.toml")) == ()
    for text in ('[host]\ndisabled_drivers = "gpu"\n', '[host]\ndisabled_drivers = [1]\n',
                 "[host\n", "host = 3\n", "[" * 5000, "\xff"):
        bad = tmp_path / "bad.toml"
        bad.write_bytes(text.encode("utf-8", "surrogateescape") if text != "\xff"
                        else b"\xff\xfe")
        assert disabled_in_config(str(bad), "/nonexistent") == ()  # the loader says why
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert disabled_in_config(str(fifo), "/nonexistent") == ()  # no hang waiting for a writer


def test_discover_and_check_config_say_which_driver_is_disabled(tmp_path):
    config = tmp_path / "host.toml"
    config.write_text('[host]\ndisabled_drivers = ["usb"]\n\n[[resource]]\nname = "x.com/y"\n'
                      'driver = "gpu"\n[resource.selectors]\nvendor = "0x10de"\n')
    (tmp_path / "root" / "sys").mkdir(parents=True)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    for argv in (["check-config", str(config), "--host-root", str(tmp_path / "root")],
                 ["discover", "--config", str(config), "--host-root", str(tmp_path / "root")]):
        done = subprocess.run([sys.executable, "-m", "host", *argv], capture_output=True,
                              text=True, timeout=60, env=env, cwd=REPO)
        assert done.returncode == 0, done.stderr
        assert "driver usb: entry point usb (" in done.stdout + done.stderr
        assert DISABLED_REASON in done.stdout + done.stderr


def test_a_disabled_driver_stays_out_of_the_drivers_loaded_after_serving_starts():
    """``run`` loads the configured drivers first and the others once serving (perf): a
    disabled one is never among either, and is reported from the start."""
    done = _python(
        "import json, sys\n"
        "from host.config.plugins import load_drivers\n"
        "registry = load_drivers(first=['usb'], disabled=['gpu'])\n"
        "early = [sorted(registry.drivers), registry.disabled_lines()]\n"
        "registry.load_pending()\n"
        "print(json.dumps(early + [sorted(registry.drivers), 'drivers.gpu' in sys.modules]))")
    assert done.returncode == 0, done.stderr
    early, early_lines, late, gpu_imported = json.loads(done.stdout)
    assert early == ["usb"] and len(early_lines) == 1 and "driver gpu" in early_lines[0]
    assert "gpu" not in late and {"usb", "sriov", "rdma"} <= set(late)
    assert gpu_imported is False
