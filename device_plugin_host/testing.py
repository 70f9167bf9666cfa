"""The test kit for driver authors, from one import: fake host trees, the kubelet simulator
and the real host running in-process.

    from device_plugin_host.testing import FakeTree, KubeletSimulator, running_host

Nothing here mocks: trees are real files under a temporary root that the real ``HostFS``
reads, the simulator speaks real gRPC over unix sockets. Only for tests: importing it loads
grpc and the host itself, which ``device_plugin_host`` alone never does.
"""

from __future__ import annotations

from host.config import default_config
from host.plugins import load_drivers
from host.testing.fixtures import run, short_dir
from host.testing.harness import kubelet_and_host, make_config, running_host
from host.testing.kubelet import AllocationError, KubeletSimulator
from host.testing.tree import FakeTree, load_machine, machine_names
from host.watch import InjectedSource

__all__ = [
    "AllocationError",
    "FakeTree",
    "InjectedSource",
    "KubeletSimulator",
    "default_config",
    "kubelet_and_host",
    "load_drivers",
    "load_machine",
    "machine_names",
    "make_config",
    "run",
    "running_host",
    "short_dir",
]
