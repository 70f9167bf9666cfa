"""RDMA char devices (``uverbsN``, ``umadN``, ``rdma_cm``) joined to the RDMA device they serve.

The kernel numbers the char devices of ``/sys/class/infiniband_verbs`` and
``/sys/class/infiniband_mad`` in probe order, not by the device's name; the only join is each
char device's ``ibdev`` file (drivers/infiniband/core/uverbs_main.c ``ibdev_show``,
user_mad.c). Both the RDMA driver and the SR-IOV driver (an RDMA VF carries its verbs node)
need that join, so it lives in the host beside host/sysfs/chardev.py, free of any driver policy.
Every read goes through HostFS; nothing here raises on odd input.
"""

from __future__ import annotations

import logging
import posixpath
from dataclasses import dataclass
from typing import Iterable, List, Optional, Tuple

from host.core.hostfs import HostFS
from host.sysfs.chardev import dev_node_path

log = logging.getLogger(__name__)

INFINIBAND_VERBS = "/sys/class/infiniband_verbs"
INFINIBAND_MAD = "/sys/class/infiniband_mad"
RDMA_CM_CLASS = "/sys/class/misc/rdma_cm"
RDMA_CM_NODE = "/dev/infiniband/rdma_cm"


@dataclass(frozen=True)
class RdmaCharDevice:
    """One ``uverbsN`` or ``umadN``: where its node is and which RDMA device it serves."""

    name: str  # uverbs0
    node: str  # /dev/infiniband/uverbs0, a host path
    present: bool  # the /dev node exists now
    ibdev: Optional[str]  # None when the ibdev file is missing or unreadable
    parent: Optional[str]  # canonical sysfs path of the device it hangs off (PCI function, SF)
    port: Optional[int] = None  # umad only


@dataclass(frozen=True)
class RdmaCharIndex:
    """Every RDMA char device of the host, read once per scan."""

    verbs: Tuple[RdmaCharDevice, ...] = ()
    umad: Tuple[RdmaCharDevice, ...] = ()
    rdma_cm: Optional[str] = None  # host path of the rdma_cm node when it exists

    def verbs_of(self, ibdev: str, parent: Optional[str], sole: bool) -> List[RdmaCharDevice]:
        return _match(self.verbs, ibdev, parent, sole)

    def umad_of(self, ibdev: str, parent: Optional[str], sole: bool) -> List[RdmaCharDevice]:
        return _match(self.umad, ibdev, parent, sole)


def _match(
    entries: Iterable[RdmaCharDevice], ibdev: str, parent: Optional[str], sole: bool
) -> List[RdmaCharDevice]:
    """Entries naming ``ibdev``; an entry whose ibdev could not be read is taken when it hangs
    off the same parent device and that parent has only this one RDMA device, because then
    the kernel's own tree says whose it is."""
    by_parent = sole and parent is not None
    return [
        entry
        for entry in entries
        if entry.ibdev == ibdev or (by_parent and entry.ibdev is None and entry.parent == parent)
    ]


def parent_of(host: HostFS, path: str) -> str:
    """The device a class device hangs off: its ``device`` link, else two levels up
    (``<parent>/infiniband/mlx5_0``), the kernel's layout for every RDMA class."""
    linked = host.resolve(f"{path}/device")
    return linked or posixpath.dirname(posixpath.dirname(path))


def scan_char_devices(host: HostFS) -> RdmaCharIndex:
    """uverbsN, umadN and rdma_cm of the host. rdma_cm is kept only when its node exists:
    it is one node for all devices, optional for verbs-only users (NCCL), and its absence
    means rdma_ucm is not loaded, not that a device is broken."""
    rdma_cm: Optional[str] = None
    node = (dev_node_path(host, RDMA_CM_CLASS, "rdma_cm", "/dev/infiniband")
            if host.exists(RDMA_CM_CLASS) else None)
    for candidate in (node, RDMA_CM_NODE):
        if candidate and host.exists(candidate):
            rdma_cm = candidate
            break
    if rdma_cm is None and node is not None:
        log.warning("rdma_cm: the kernel has it (%s) but %s is missing", RDMA_CM_CLASS, node)
    return RdmaCharIndex(
        verbs=tuple(_char_devices(host, INFINIBAND_VERBS, "uverbs")),
        umad=tuple(_char_devices(host, INFINIBAND_MAD, "umad")),
        rdma_cm=rdma_cm,
    )


def _char_devices(host: HostFS, class_dir: str, prefix: str) -> List[RdmaCharDevice]:
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
        node = dev_node_path(host, path, name, "/dev/infiniband")
        port = host.read_int(f"{path}/port", 10) if prefix == "umad" else None
        out.append(
            RdmaCharDevice(
                name=name,
                node=node,
                present=host.exists(node),
                ibdev=ibdev,
                parent=parent_of(host, path),
                port=port,
            )
        )
    return out
