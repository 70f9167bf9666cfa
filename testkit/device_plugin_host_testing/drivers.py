"""Drivers for tests of the host itself: devices from memory, faults on demand.

The host's contract with drivers is what these exercise: whole snapshots, exceptions, hangs
and garbage. Hardware drivers are tested on fake sysfs trees instead.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Dict, List, Mapping, Optional, Sequence

from host.core.driver import Driver
from host.core.hostfs import HostFS
from host.core.model import (
    ContainerAllocation,
    Device,
    DeviceNode,
    PreferredRequest,
    ResourceConfig,
)


def make_devices(prefix: str, count: int, numa: Sequence[int] = (0,)) -> List[Device]:
    """``count`` devices in equal blocks over the given NUMA nodes (0-3 on node 0, ...)."""
    per_node = max(1, -(-count // max(1, len(numa))))
    return [
        Device(
            id=f"{prefix}{i}",
            numa_nodes=(numa[i // per_node],) if numa else (),
            device_nodes=(DeviceNode(f"/dev/{prefix}{i}"),),
            env={"VISIBLE": f"{prefix}{i}"},
        )
        for i in range(count)
    ]


class MemoryDriver(Driver):
    """Devices per resource from a dict the test edits; ``fail``/``hang`` inject faults."""

    subsystems = ("memory",)
    selector_types = {"tag": (str,)}
    setting_types = {"pre_start": (bool,)}

    def __init__(self, name: str = "memory", devices: Optional[Dict[str, List[Device]]] = None):
        self.name = name  # type: ignore[misc]
        self.devices: Dict[str, List[Device]] = devices or {}
        self.fail: Optional[Exception] = None
        self.hang = threading.Event()  # set() = calls block until release is set
        self.release = threading.Event()
        self.scans = 0
        self._scanned = threading.Condition()
        self.pre_starts: List[List[str]] = []

    def discover(
        self, host: HostFS, resources: Sequence[ResourceConfig]
    ) -> Mapping[str, Sequence[Device]]:
        with self._scanned:
            self.scans += 1
            self._scanned.notify_all()
        if self.hang.is_set():
            self.release.wait(30)
        if self.fail is not None:
            raise self.fail
        return {r.name: list(self.devices.get(r.name, ())) for r in resources}

    async def scanned(self, count: int, timeout: float = 10.0) -> None:
        """Wait until ``discover`` has been called ``count`` times in all. The host scans a
        driver one call at a time, so once call ``count`` began, the ones before it were
        handled: a test shows "those checks changed nothing" by this count, not by a sleep
        that may or may not have covered them."""

        def wait() -> bool:
            with self._scanned:
                return self._scanned.wait_for(lambda: self.scans >= count, timeout)

        if not await asyncio.get_running_loop().run_in_executor(None, wait):
            raise AssertionError(f"{self.name}: {self.scans} scans within {timeout} s, "
                                 f"not {count}")

    def needs_pre_start(self, resource: ResourceConfig) -> bool:
        return bool(resource.settings.get("pre_start"))

    def pre_start(self, resource: ResourceConfig, devices: Sequence[Device]) -> None:
        self.pre_starts.append([d.id for d in devices])
        if self.fail is not None:
            raise self.fail


class SlowAllocateDriver(MemoryDriver):
    """Allocate hook that takes ``delay`` seconds, to test the allocate timeout."""

    def __init__(self, name: str, devices: Dict[str, List[Device]], delay: float) -> None:
        super().__init__(name, devices)
        self.delay = delay

    def allocate(self, resource: ResourceConfig, devices: Sequence[Device],
                 merged: ContainerAllocation) -> ContainerAllocation:
        time.sleep(self.delay)
        return merged


class ReversePreferenceDriver(MemoryDriver):
    """A driver with its own preferred policy: the highest ids first."""

    def preferred(self, resource: ResourceConfig, request: PreferredRequest) -> Optional[List[str]]:
        must = [d.id for d in request.must_include]
        rest = sorted((d.id for d in request.available if d.id not in must), reverse=True)
        return (must + rest)[: request.size]
