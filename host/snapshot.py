"""The current device list of one resource, encoded once, waited on by ListAndWatch streams.

Only what the kubelet sees (id, health, NUMA nodes) decides whether a device's cached encoding
is reused, so a rescan that rebuilds 10,000 Device objects re-encodes only the ones whose wire
form changed, and a full snapshot is a join of cached bytes.
"""

from __future__ import annotations

import asyncio
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from host.model import Device, Health
from host.protocol.convert import framed_device, snapshot_payload

_WireKey = Tuple[Health, Tuple[int, ...]]


class Snapshot:
    def __init__(self) -> None:
        self.version = 0
        self.devices: Dict[str, Device] = {}
        self._wire: Dict[str, Tuple[_WireKey, bytes]] = {}
        self._payload: Optional[bytes] = b""
        self._changed: Optional[asyncio.Future] = None

    def update(self, devices: Sequence[Device]) -> bool:
        """Replace the device list; True (and streams woken) when the kubelet's view changed."""
        old_wire = self._wire
        old_devices = self.devices
        new_wire: Dict[str, Tuple[_WireKey, bytes]] = {}
        changed = len(devices) != len(old_wire)
        old_ids = iter(old_wire)
        for device in devices:
            device_id = device.id
            cached = old_wire.get(device_id)
            # The same object as last time (a one-device change in a 10,000-device list):
            # nothing to compare or encode.
            if cached is not None and old_devices.get(device_id) is device:
                new_wire[device_id] = cached
            else:
                key = (device.health, device.numa_nodes)
                if cached is not None and cached[0] == key:
                    new_wire[device_id] = cached
                else:
                    new_wire[device_id] = (key, framed_device(device))
                    changed = True
            if not changed and next(old_ids, None) != device_id:
                changed = True  # same devices, new order: the kubelet sees a new list
        self.devices = {device.id: device for device in devices}
        if not changed:
            return False
        self._wire = new_wire
        self._payload = None
        self.version += 1
        waiter, self._changed = self._changed, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        return True

    @property
    def payload(self) -> bytes:
        """The serialized ListAndWatchResponse for the current version."""
        if self._payload is None:
            self._payload = snapshot_payload(entry[1] for entry in self._wire.values())
        return self._payload

    async def next_payload(self, seen_version: int) -> Tuple[int, bytes]:
        """The payload newer than ``seen_version``, waiting for a change when there is none."""
        while self.version == seen_version:
            if self._changed is None:
                self._changed = asyncio.get_running_loop().create_future()
            await asyncio.shield(self._changed)
        return self.version, self.payload

    def get(self, ids: Iterable[str]) -> List[Optional[Device]]:
        return [self.devices.get(device_id) for device_id in ids]
