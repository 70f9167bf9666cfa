"""RDMA devices and their user-space char devices, read from the kernel's sysfs classes.

The kernel names an RDMA device (``mlx5_0``) in ``/sys/class/infiniband`` and its char devices
(``uverbsN``, ``umadN``) in separate classes whose numbers follow probe order, not the device's
name; the only join between them is each char device's ``ibdev`` file. Both the RDMA and the
SR-IOV driver need that join (an RDMA VF carries its verbs node), so it lives here, free of any
driver policy. Every read goes through HostFS; nothing here raises on odd input.
"""

from __future__ import annotations

import logging
import posixpath
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from host.hostfs import HostFS

log = logging.getLogger(__name__)

INFINIBAND = "/sys/class/infiniband"
INFINIBAND_VERBS = "/sys/class/infiniband_verbs"
INFINIBAND_MAD = "/sys/class/infiniband_mad"
RDMA_CM_CLASS = "/sys/class/misc/rdma_cm"
RDMA_CM_NODE = "/dev/infiniband/rdma_cm"

#: Link layers as ``ports/N/link_layer`` spells them, keyed by lower case for selectors.
LINK_LAYERS = {"infiniband": "InfiniBand", "ethernet": "Ethernet"}


@dataclass(frozen=True)
class CharDevice:
    """One ``uverbsN`` or ``umadN``: where its node is and which RDMA device it serves."""

    name: str  # uverbs0
    node: str  # /dev/infiniband/uverbs0, a host path
    present: bool  # the /dev node exists now
    ibdev: Optional[str]  # None when the ibdev file is missing or unreadable
    parent: Optional[str]  # canonical sysfs path of the device it hangs off (PCI function, SF)
    port: Optional[int] = None  # umad only


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


@dataclass(frozen=True)
class CharIndex:
    """Every RDMA char device of the host, read once per scan."""

    verbs: Tuple[CharDevice, ...] = ()
    umad: Tuple[CharDevice, ...] = ()
    rdma_cm: Optional[str] = None  # host path of the rdma_cm node when it exists

    def verbs_of(self, ibdev: str, parent: Optional[str], sole: bool) -> List[CharDevice]:
        return _match(self.verbs, ibdev, parent, sole)

    def umad_of(self, ibdev: str, parent: Optional[str], sole: bool) -> List[CharDevice]:
        return _match(self.umad, ibdev, parent, sole)


def _match(
    entries: Iterable[CharDevice], ibdev: str, parent: Optional[str], sole: bool
) -> List[CharDevice]:
    """Entries naming ``ibdev``; an entry whose ibdev could not be read is taken when it hangs
    off the same parent device and that parent has only this one RDMA device, because then
    the kernel's own tree says whose it is."""
    by_parent = sole and parent is not None
    return [
        entry
        for entry in entries
        if entry.ibdev == ibdev or (by_parent and entry.ibdev is None and entry.parent == parent)
    ]


def _state_word(text: Optional[str]) -> Optional[str]:
    """The word of "4: ACTIVE": the number is the IB spec's, the word is what people read."""
    if not text:
        return None
    return text.split(":", 1)[1].strip() if ":" in text else text.strip()


def _parent_of(host: HostFS, path: str) -> str:
    """The device a class device hangs off: its ``device`` link, else two levels up
    (``<parent>/infiniband/mlx5_0``), the kernel's layout for every RDMA class."""
    linked = host.resolve(f"{path}/device")
    return linked or posixpath.dirname(posixpath.dirname(path))


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
    parent = _parent_of(host, path)
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


def _node_path(host: HostFS, class_path: str, name: str) -> str:
    """The /dev path udev gives a class device: DEVNAME from its uevent, else the kernel's
    default ``infiniband/<name>``. A DEVNAME that climbs out of /dev is ignored."""
    uevent = host.read(f"{class_path}/uevent") or ""
    for line in uevent.splitlines():
        key, _, value = line.partition("=")
        value = value.strip()
        if key.strip() != "DEVNAME" or not value or value.startswith("/"):
            continue
        if ".." not in value.split("/"):
            return f"/dev/{value}"
    return f"/dev/infiniband/{name}"


def _char_devices(host: HostFS, class_dir: str, prefix: str) -> List[CharDevice]:
    out = []
    for name in host.listdir(class_dir):
        # abi_version sits beside the devices as a plain file; issmN is not handed out
        # (it lets a process claim the port's subnet-manager bit).
        if not name.startswith(prefix) or not name[len(prefix) :].isdigit():
            continue
        link = f"{class_dir}/{name}"
        path = host.resolve(link)
        if path is None:
            log.warning("RDMA char device %s: %s is a dangling link; skipped", name, link)
            continue
        ibdev = host.read(f"{path}/ibdev") or None
        if ibdev is None:
            log.warning(
                "RDMA char device %s: %s/ibdev is missing or unreadable; matching it by its "
                "parent device instead",
                name,
                link,
            )
        node = _node_path(host, path, name)
        port = host.read_int(f"{path}/port", 10) if prefix == "umad" else None
        out.append(
            CharDevice(
                name=name,
                node=node,
                present=host.exists(node),
                ibdev=ibdev,
                parent=_parent_of(host, path),
                port=port,
            )
        )
    return out


def scan_char_devices(host: HostFS) -> CharIndex:
    """uverbsN, umadN and rdma_cm of the host. rdma_cm is kept only when its node exists:
    it is one node for all devices, optional for verbs-only users (NCCL), and its absence
    means rdma_ucm is not loaded, not that a device is broken."""
    rdma_cm: Optional[str] = None
    node = _node_path(host, RDMA_CM_CLASS, "rdma_cm") if host.exists(RDMA_CM_CLASS) else None
    for candidate in (node, RDMA_CM_NODE):
        if candidate and host.exists(candidate):
            rdma_cm = candidate
            break
    if rdma_cm is None and node is not None:
        log.warning("rdma_cm: the kernel has it (%s) but %s is missing", RDMA_CM_CLASS, node)
    return CharIndex(
        verbs=tuple(_char_devices(host, INFINIBAND_VERBS, "uverbs")),
        umad=tuple(_char_devices(host, INFINIBAND_MAD, "umad")),
        rdma_cm=rdma_cm,
    )


def count_by_parent(devices: Sequence[IbDevice]) -> Dict[str, int]:
    """How many RDMA devices hang off each parent: the ibdev fallback needs exactly one."""
    counts: Dict[str, int] = {}
    for device in devices:
        counts[device.parent] = counts.get(device.parent, 0) + 1
    return counts
