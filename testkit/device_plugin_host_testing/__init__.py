"""The test kit for driver authors, from one import: fake host trees, the kubelet simulator
and the real host running in-process.

    from device_plugin_host_testing import FakeTree, KubeletSimulator, running_host

Nothing here mocks: trees are real files under a temporary root that the real ``HostFS``
reads, the simulator speaks real gRPC over unix sockets. Only for tests: the names below load
grpc and the host itself, which ``device_plugin_host`` alone never does.

Each name is imported when first used, so importing one of the kit's modules
(``device_plugin_host_testing.drivers`` in a benchmark's host process, say) loads that module
and what it needs, not the kubelet simulator and the rest.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Dict

if TYPE_CHECKING:
    from device_plugin_host_testing.fixtures import run, short_dir
    from device_plugin_host_testing.harness import kubelet_and_host, make_config, running_host
    from device_plugin_host_testing.machines import load_machine, machine_names
    from host.config import default_config
    from host.config.plugins import load_drivers
    from host.sim.kubelet import AllocationError, KubeletSimulator
    from host.sim.tree import FakeTree
    from host.triggers.uevents import InjectedSource

#: Each public name and the module it comes from.
_SOURCES: Dict[str, str] = {
    "AllocationError": "host.sim.kubelet",
    "FakeTree": "host.sim.tree",
    "InjectedSource": "host.triggers.uevents",
    "KubeletSimulator": "host.sim.kubelet",
    "default_config": "host.config",
    "kubelet_and_host": "device_plugin_host_testing.harness",
    "load_drivers": "host.config.plugins",
    "load_machine": "device_plugin_host_testing.machines",
    "machine_names": "device_plugin_host_testing.machines",
    "make_config": "device_plugin_host_testing.harness",
    "run": "device_plugin_host_testing.fixtures",
    "running_host": "device_plugin_host_testing.harness",
    "short_dir": "device_plugin_host_testing.fixtures",
}

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


def __getattr__(name: str) -> Any:
    source = _SOURCES.get(name)
    if source is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(source), name)
    globals()[name] = value
    return value


def __dir__() -> list:
    return sorted(set(globals()) | set(__all__))
