"""The current device list of one resource, encoded once, waited on by ListAndWatch streams.

Only what the kubelet sees (id, health, NUMA nodes) decides whether a device's cached encoding
is reused, so a rescan that rebuilds 10,000 Device objects re-encodes only the ones whose wire
form changed, and a full snapshot is a join of cached bytes. One dict per version holds each
device with its encoding: an update over 10,000 devices builds nothing else.
"""

from __future__ import annotations

import asyncio
from typing import Dict, List, Optional, Sequence, Tuple

from host.model import Device, Health
from host.protocol.convert import framed_device, snapshot_payload

_WireKey = Tuple[Health, Tuple[int, ...]]
_Entry = Tuple[Device, _WireKey, bytes]  # the device, what the kubelet sees of it, its bytes


class Snapshot:
    def __init__(self) -> None:
        self.version = 0
        self._entries: Dict[str, _Entry] = {}
        self._payload: Optional[bytes] = b""
        self._changed: Optional[asyncio.Future] = None

    def update(self, devices: Sequence[Device]) -> bool:
        """Replace the device list; True (and streams woken) when the kubelet's view changed."""
        old = self._entries
        entries: Dict[str, _Entry] = {}
        changed = len(devices) != len(old)
        old_ids = iter(old)
        for device in devices:
            device_id = device.id
            entry = old.get(device_id)
            if entry is None:
                entries[device_id] = (device, *self._encode(device))
                changed = True
            elif entry[0] is device:
                # The same object as last time (one change in a 10,000-device list).
                entries[device_id] = entry
            else:
                key = (device.health, device.numa_nodes)
                if entry[1] == key:
                    entries[device_id] = (device, key, entry[2])
                else:
                    entries[device_id] = (device, key, framed_device(device))
                    changed = True
            if not changed and next(old_ids, None) != device_id:
                changed = True  # same devices, new order: the kubelet sees a new list
        self._entries = entries
        if not changed:
            return False
        self._payload = None
        self.version += 1
        waiter, self._changed = self._changed, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        return True

    @staticmethod
    def _encode(device: Device) -> Tuple[_WireKey, bytes]:
        return (device.health, device.numa_nodes), framed_device(device)

    def device(self, device_id: str) -> Optional[Device]:
        entry = self._entries.get(device_id)
        return None if entry is None else entry[0]

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def devices(self) -> List[Device]:
        return [entry[0] for entry in self._entries.values()]

    @property
    def payload(self) -> bytes:
        """The serialized ListAndWatchResponse for the current version."""
        if self._payload is None:
            self._payload = snapshot_payload(entry[2] for entry in self._entries.values())
        return self._payload

    async def next_payload(self, seen_version: int) -> Tuple[int, bytes]:
        """The payload newer than ``seen_version``, waiting for a change when there is none."""
        while self.version == seen_version:
            if self._changed is None:
                self._changed = asyncio.get_running_loop().create_future()
            await asyncio.shield(self._changed)
        return self.version, self.payload
