"""What the daemon's start-up path imports: modules that only some commands or settings need
load when they are used, so ``device-plugin-host run`` starts close to what a bare
grpc process costs. Each check runs in a fresh interpreter and reads its sys.modules."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import List

REPO = Path(__file__).resolve().parents[1]

#: Never on the daemon's path: prometheus_client and the HTTP/email stack it pulls in (the
#: metrics are host/metrics/prom.py's). Needed only by some commands or settings: the kubelet's
#: PodResources API (``pods``, device-info cleanup), the benchmarks' psutil, the test kit,
#: DRA and HTTP clients; importlib.metadata and email are what a distributions() walk for
#: entry points costs.
NOT_ON_THE_DAEMON_PATH = (
    "prometheus_client", "http.server", "wsgiref", "email", "importlib.metadata",
    "host.kubelet.podresources", "host.kubelet.protocol.podresources_v1_pb2", "psutil", "pyudev",
    "host.sim", "device_plugin_host_testing", "hypothesis", "pytest", "httpx", "host.dra",
    "difflib", "tempfile",
)


def _modules_after(code: str) -> List[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run(
        [sys.executable, "-c", code + "\nimport json, sys; print(json.dumps(sorted(sys.modules)))"],
        capture_output=True, text=True, cwd=REPO, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def _loaded(modules: List[str], names=NOT_ON_THE_DAEMON_PATH) -> List[str]:
    return [name for name in names
            if any(m == name or m.startswith(name + ".") for m in modules)]


def test_importing_the_daemon_and_loading_drivers_imports_nothing_optional():
    modules = _modules_after(
        "import host.cli, host.app\n"
        "from host.config.plugins import load_drivers\n"
        "registry = load_drivers()\n"
        "assert {'gpu', 'usb', 'sriov', 'fpga', 'rdma'} <= set(registry.drivers)\n")
    assert _loaded(modules) == []
    assert "grpc" in modules and "host.kubelet.service" in modules  # the check sees real imports


def test_reading_a_config_with_a_metrics_address_does_not_load_prometheus(tmp_path):
    config = tmp_path / "host.toml"
    config.write_text('[host]\nmetrics_address = "127.0.0.1:9400"\n')
    modules = _modules_after(
        "from host.config import load_config\n"
        "from host.config.plugins import load_drivers\n"
        f"load_config({str(config)!r}, load_drivers().with_unavailable())\n")
    assert _loaded(modules) == []


def test_metrics_and_pod_resources_load_when_used():
    modules = _modules_after(
        "from host.metrics import HostMetrics\n"
        "HostMetrics(pod_resources_socket='/nonexistent/kubelet.sock')\n"
        "from host.kubelet.protocol import podresources\n"
        "assert podresources.ListPodResourcesRequest\n")
    # The metrics are the host's own (host/metrics/prom.py): prometheus_client is never loaded.
    assert _loaded(modules, ("prometheus_client", "host.kubelet.protocol.podresources_v1_pb2")) == [
        "host.kubelet.protocol.podresources_v1_pb2"]
    assert "host.metrics.prom" in modules
    assert "host.kubelet.podresources" not in modules  # its client is made at the first scrape


def test_run_loads_the_configured_drivers_first_and_the_others_later():
    modules = _modules_after(
        "from host.config.plugins import load_drivers\n"
        "registry = load_drivers(first=['gpu'])\n"
        "assert set(registry.drivers) == {'gpu'}, registry.drivers\n"
        "import sys\n"
        "early = sorted(m for m in sys.modules if m.startswith('drivers.'))\n"
        "assert all(m.startswith('drivers.gpu') for m in early), early\n"
        "registry.load_pending(other_packages_only=True)\n"
        "assert 'usb' not in registry.drivers and registry.has_pending  # ours wait\n"
        "assert registry.load_pending() and not registry.load_pending()\n"
        "assert {'gpu', 'usb', 'sriov', 'fpga', 'rdma'} <= set(registry.drivers)\n")
    assert "drivers.usb" in modules
    # A name no entry point has: a package whose drivers are named otherwise, so all load.
    _modules_after(
        "from host.config.plugins import load_drivers\n"
        "registry = load_drivers(first=['widget'])\n"
        "assert {'gpu', 'usb', 'sriov'} <= set(registry.drivers)\n")


def test_configured_drivers_reads_only_what_a_file_clearly_says(tmp_path):
    from host.config.plugins import configured_drivers

    path = tmp_path / "host.toml"
    path.write_text('[[resource]]\nname = "example.com/a"\ndriver = "gpu"\n'
                    '[[resource]]\nname = "example.com/b"\ndriver = "usb"\n'
                    '[[resource]]\nname = "example.com/c"\ndriver = "gpu"\n')
    assert configured_drivers(str(path)) == ["gpu", "usb"]
    path.write_text('[host]\nlog_level = "info"\n')  # the drivers' defaults: all of them
    assert configured_drivers(str(path)) is None
    path.write_text('[[resource]]\nname = "example.com/a"\n')  # no driver: load_config says
    assert configured_drivers(str(path)) is None
    path.write_text("[[resource]\nbroken")
    assert configured_drivers(str(path)) is None
    assert configured_drivers(str(tmp_path / "missing.toml")) is None
    assert configured_drivers(None) is None
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert configured_drivers(str(fifo)) is None  # never blocks waiting for a writer
