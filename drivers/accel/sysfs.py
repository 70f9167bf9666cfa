"""The accel class as sysfs shows it, read once per scan (no decisions about health here).

drivers/accel/drm_accel.c registers every accel minor in the class ``accel`` with the device
type ``accel_minor``, the name ``accel<index>`` and the devnode ``accel/%s`` (so DEVNAME in
its uevent is ``accel/accel0``), under the DRM device's parent: the PCI function of a card,
the platform device of a SoC NPU::

    /sys/class/accel/accel0 -> ../../devices/pci0000:00/0000:00:0b.0/accel/accel0
    .../0000:00:0b.0/accel/accel0/dev       261:0       (ACCEL_MAJOR, include/drm/drm_accel.h)
    .../0000:00:0b.0/accel/accel0/device -> ../../../0000:00:0b.0

habanalabs (drivers/accel/habanalabs/common/device.c, ``cdev_sysfs_debugfs_add``) adds a
control device per card in the same class with no parent, named ``accel_controlD<index>``
after the accel index, on the driver's own dynamic major: it lands in
/sys/devices/virtual/accel/. Its card facts (``status``, ``device_type``, ``serial_number``,
``module_id``; Documentation/ABI/testing/sysfs-driver-habanalabs, "/sys/class/accel/accel<n>/
device/...") live on the PCI function, which is the accel minor's ``device``.

A Gaudi 3 card is also its own scale-out RDMA NIC: habanalabs' InfiniBand driver (hbl,
``hbl_ib_dev_init``) registers ``hbl_<id>`` with the card's PCI function as parent, and
ib_uverbs gives it a ``uverbsN`` under the same parent (``<function>/infiniband_verbs/
uverbsN``, ``ibdev`` = ``hbl_<id>``, /dev/infiniband/uverbsN). N follows ib_uverbs'
registration order over every RDMA device of the host (host NICs first, cards as they probe),
so the join is sysfs's: the RDMA devices whose ``device`` is the card, and the verbs devices
whose ``ibdev`` names one of them (host/sysfs/rdma_chardev.py). Intel's Gaudi DRA driver puts that
node in each card's CDI device; so does this one.
"""

from __future__ import annotations

import logging
import posixpath
import re
from dataclasses import dataclass, replace
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from device_plugin_host import (
    HostFS,
    PciFunction,
    RdmaCharDevice,
    dev_node_path,
    is_pci_address,
    parent_device,
    parent_of,
    read_function,
    scan_char_devices,
)

log = logging.getLogger(__name__)

ACCEL_CLASS = "/sys/class/accel"
INFINIBAND = "/sys/class/infiniband"
HABANA_DRIVER = "habanalabs"
#: Card facts habanalabs publishes on the PCI function (sysfs-driver-habanalabs).
HABANA_FACTS = ("status", "device_type", "serial_number", "module_id")

_MINOR = re.compile(r"accel(\d+)\Z")


@dataclass(frozen=True)
class CardRdma:
    """An RDMA device whose parent is the card, with its verbs char devices."""

    name: str  # hbl_0
    verbs: Tuple[RdmaCharDevice, ...]  # uverbsN: node path and presence


@dataclass(frozen=True)
class AccelMinor:
    name: str  # accel0
    index: int
    path: str  # canonical /sys/devices/.../accel/accel0
    dev_node: str  # /dev/accel/accel0
    dev_numbers: Optional[str]  # "261:0"
    parent: str  # canonical /sys/devices/... path of the owning device
    parent_name: str  # 0000:00:0b.0, 17f0000.npu
    pci: Optional[PciFunction]
    kernel_driver: Optional[str]
    numa_nodes: Tuple[int, ...]
    control_node: Optional[str]  # /dev/accel/accel_controlD0 (habanalabs)
    facts: Mapping[str, str]
    rdma: Tuple[CardRdma, ...] = ()  # the card's own RDMA devices (Gaudi 3 hbl_N)


def scan_minors(host: HostFS) -> List[AccelMinor]:
    """Every accel minor, in index order. One without a parent device is skipped (logged):
    the parent is what gives it a stable id and its NUMA node."""
    valid_numa = host.machine_numa_nodes()
    found = []
    for name in host.listdir(ACCEL_CLASS):
        match = _MINOR.match(name)
        if match is None:
            continue  # accel_controlD<N>: a companion of accel<N>, found by index
        minor = _read_minor(host, name, int(match.group(1)), valid_numa)
        if minor is not None:
            found.append(minor)
    if any(m.kernel_driver == HABANA_DRIVER and m.pci is not None for m in found):
        found = _with_card_rdma(host, found)
    return sorted(found, key=lambda m: m.index)


def _with_card_rdma(host: HostFS, minors: List[AccelMinor]) -> List[AccelMinor]:
    """habanalabs minors with the RDMA devices hanging off their PCI function."""
    cards = {m.parent for m in minors if m.kernel_driver == HABANA_DRIVER and m.pci is not None}
    by_card: Dict[str, List[str]] = {}
    for name in host.listdir(INFINIBAND):
        path = host.resolve(f"{INFINIBAND}/{name}")
        if path is None:
            continue
        parent = parent_of(host, path)
        if parent in cards:
            by_card.setdefault(parent, []).append(name)
    if not by_card:
        return minors
    chars = scan_char_devices(host)
    out = []
    for minor in minors:
        names = sorted(by_card.get(minor.parent, ()))
        if not names or minor.kernel_driver != HABANA_DRIVER:
            out.append(minor)
            continue
        sole = len(names) == 1
        rdma = tuple(
            CardRdma(name, tuple(sorted(chars.verbs_of(name, minor.parent, sole),
                                        key=lambda c: (len(c.name), c.name))))
            for name in names
        )
        out.append(replace(minor, rdma=rdma))
    return out


def _read_minor(
    host: HostFS, name: str, index: int, valid_numa: Optional[Sequence[int]]
) -> Optional[AccelMinor]:
    path = host.resolve(f"{ACCEL_CLASS}/{name}")
    if path is None:
        log.warning("accel: /sys/class/accel/%s is dangling; skipped", name)
        return None
    parent = parent_device(host, path)
    if parent is None:
        log.warning("accel: %s has no parent device (%s/device); skipped", name, path)
        return None
    parent_name = posixpath.basename(parent)
    pci = read_function(host, parent_name, valid_numa) if is_pci_address(parent_name) else None
    if pci is not None:
        kernel_driver = pci.kernel_driver
        numa_nodes = pci.numa_nodes
    else:
        kernel_driver = host.link_name(f"{parent}/driver")
        numa_nodes = host.numa_of(parent)
        if numa_nodes and valid_numa is not None and numa_nodes[0] not in valid_numa:
            numa_nodes = ()
    facts: Dict[str, str] = {}
    if kernel_driver == "habanalabs":
        for fact in HABANA_FACTS:
            value = host.read(f"{parent}/{fact}")
            if value:
                facts[fact] = value
    control = f"accel_controlD{index}"
    control_node = None
    control_path = host.resolve(f"{ACCEL_CLASS}/{control}")
    if control_path is not None:
        control_node = dev_node_path(host, control_path, f"accel/{control}")
    return AccelMinor(
        name=name,
        index=index,
        path=path,
        dev_node=dev_node_path(host, path, f"accel/{name}"),
        dev_numbers=host.read(f"{path}/dev") or None,
        parent=parent,
        parent_name=parent_name,
        pci=pci,
        kernel_driver=kernel_driver,
        numa_nodes=numa_nodes,
        control_node=control_node,
        facts=facts,
    )
