"""Model records to wire messages.

ListAndWatch snapshots are assembled from per-device encoded bytes: a repeated message field is
just its elements' encodings, each behind a tag and a length, so a 10,000-device snapshot is a
join of cached byte strings instead of 10,000 Python message objects.
"""

from __future__ import annotations

from typing import Iterable

from host.core.model import ContainerAllocation, Device
from host.kubelet.protocol import api

_DEVICES_TAG = b"\x0a"  # field 1 (devices), wire type 2 (length-delimited)


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        bits = value & 0x7F
        value >>= 7
        if value:
            out.append(bits | 0x80)
        else:
            out.append(bits)
            return bytes(out)


def device_message(device: Device) -> api.Device:
    message = api.Device(ID=device.id, health=device.health.value)
    if device.numa_nodes:  # unknown NUMA: no topology field at all, never -1
        message.topology.nodes.extend(api.NUMANode(ID=node) for node in device.numa_nodes)
    return message


def framed_device(device: Device) -> bytes:
    """One device as an element of ListAndWatchResponse.devices, ready to concatenate."""
    body = device_message(device).SerializeToString()
    return _DEVICES_TAG + _varint(len(body)) + body


def snapshot_payload(framed: Iterable[bytes]) -> bytes:
    """A serialized ListAndWatchResponse from framed device encodings."""
    return b"".join(framed)


def allocate_response(allocation: ContainerAllocation) -> api.ContainerAllocateResponse:
    response = api.ContainerAllocateResponse()
    response.envs.update(allocation.envs)
    response.annotations.update(allocation.annotations)
    response.mounts.extend(
        api.Mount(container_path=m.container_path, host_path=m.host_path, read_only=m.read_only)
        for m in allocation.mounts
    )
    response.devices.extend(
        api.DeviceSpec(
            container_path=n.container_path, host_path=n.host_path, permissions=n.permissions
        )
        for n in allocation.device_nodes
    )
    response.cdi_devices.extend(api.CDIDevice(name=name) for name in allocation.cdi_devices)
    return response
