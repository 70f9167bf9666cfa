"""RDMA devices and their user-space char devices, read from the kernel's sysfs classes.

The kernel names an RDMA device (``mlx5_0``) in ``/sys/class/infiniband`` and its char devices
(``uverbsN``, ``umadN``) in separate classes whose numbers follow probe order, not the device's
name; the only join between them is each char device's ``ibdev`` file. Both the RDMA and the
SR-IOV driver need that join (an RDMA VF carries its verbs node), so it lives in the host
(host/sysfs/rdma_chardev.py), free of any driver policy; this module reads the RDMA devices.
Every read goes through HostFS; nothing here raises on odd input.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from device_plugin_host import HostFS, parent_of

log = logging.getLogger(__name__)

INFINIBAND = "/sys/class/infiniband"

#: Link layers as ``ports/N/link_layer`` spells them, keyed by lower case for selectors.
LINK_LAYERS = {"infiniband": "InfiniBand", "ethernet": "Ethernet"}


@dataclass(frozen=True)
class IbPort:
    number: int
    state: Optional[str]  # "ACTIVE" from "4: ACTIVE"
    phys_state: Optional[str]  # "LinkUp" from "5: LinkUp"
    link_layer: Optional[str]  # "InfiniBand" | "Ethernet"


@dataclass(frozen=True)
class IbDevice:
    """An RDMA device of /sys/class/infiniband, with the device it hangs off."""

    name: str  # mlx5_0
    path: str  # canonical /sys/devices/.../infiniband/mlx5_0
    parent: str  # the PCI function, or an auxiliary device (mlx5 SF) below one
    pci_path: Optional[str]  # nearest PCI function at or above parent; None for rxe/siw
    ports: Tuple[IbPort, ...]
    node_guid: Optional[str]
    netdevs: Tuple[str, ...]  # interfaces of the parent device (RoCE netdev, IPoIB)

    @property
    def link_layers(self) -> Tuple[str, ...]:
        seen: List[str] = []
        for port in self.ports:
            if port.link_layer and port.link_layer not in seen:
                seen.append(port.link_layer)
        return tuple(seen)


def _state_word(text: Optional[str]) -> Optional[str]:
    """The word of "4: ACTIVE": the number is the IB spec's, the word is what people read."""
    if not text:
        return None
    return text.split(":", 1)[1].strip() if ":" in text else text.strip()


def read_ports(host: HostFS, path: str) -> Tuple[IbPort, ...]:
    ports = []
    for name in host.listdir(f"{path}/ports"):
        if not name.isdigit():
            continue
        base = f"{path}/ports/{name}"
        ports.append(
            IbPort(
                number=int(name),
                state=_state_word(host.read(f"{base}/state")),
                phys_state=_state_word(host.read(f"{base}/phys_state")),
                link_layer=host.read(f"{base}/link_layer") or None,
            )
        )
    return tuple(sorted(ports, key=lambda port: port.number))


def read_ib_device(host: HostFS, name: str, path: str) -> IbDevice:
    """One RDMA device whose canonical sysfs path is known."""
    parent = parent_of(host, path)
    return IbDevice(
        name=name,
        path=path,
        parent=parent,
        pci_path=host.pci_ancestor(parent),
        ports=read_ports(host, path),
        node_guid=host.read(f"{path}/node_guid") or None,
        netdevs=tuple(host.listdir(f"{parent}/net")),
    )


def list_ib_devices(host: HostFS) -> List[IbDevice]:
    """Every device of /sys/class/infiniband that resolves; dangling entries are logged."""
    out = []
    for name in host.listdir(INFINIBAND):
        path = host.resolve(f"{INFINIBAND}/{name}")
        if path is None:
            log.warning("RDMA device %s: %s/%s is a dangling link; skipped", name, INFINIBAND, name)
            continue
        out.append(read_ib_device(host, name, path))
    return out


def count_by_parent(devices: Sequence[IbDevice]) -> Dict[str, int]:
    """How many RDMA devices hang off each parent: the ibdev fallback needs exactly one."""
    counts: Dict[str, int] = {}
    for device in devices:
        counts[device.parent] = counts.get(device.parent, 0) + 1
    return counts
