"""Network and RDMA hardware for FakeTree, in the shapes the kernel gives them.

SR-IOV: a PF with ``sriov_numvfs``/``sriov_totalvfs``/``sriov_offset``/``sriov_stride`` and one
``virtfnN`` link per VF; each VF a real PCI function beside the PF (same bridge, address from
the PF's routing id + offset + stride * N, as the PCIe spec computes it) with ``physfn`` back,
its own IOMMU group, and either a netdev driver with ``net/<ifname>`` or vfio-pci with
``/dev/vfio/<group>``. RDMA: ``/sys/class/infiniband/<dev>`` linking into
``<parent>/infiniband/<dev>`` with ``ports/N``, and the char devices the kernel puts beside it
(``<parent>/infiniband_verbs/uverbsN``, ``<parent>/infiniband_mad/umadN``) with their class
links, ``ibdev`` files, uevents and /dev nodes. Every helper returns what a test needs to
break the tree afterwards (paths of nodes, links and attributes).

SR-IOV and RDMA share the PCI function and netdev builders.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Collection, List, Optional, Sequence

from host.sim.tree import FakeTree

ARPHRD_ETHER = 1
ARPHRD_INFINIBAND = 32

UVERBS_MAJOR = 231
VFIO_MAJOR = 243
MISC_MAJOR = 10
VFIO_CDEV_MAJOR = 511  # dynamic (alloc_chrdev_region "vfio-dev"); any free major


def vf_address(pf_address: str, offset: int, stride: int, index: int) -> str:
    """The PCIe rule: VF routing id = PF routing id + First VF Offset + stride * index."""
    domain, bus, rest = pf_address.split(":")
    slot, func = rest.split(".")
    rid = (int(bus, 16) << 8) | (int(slot, 16) << 3) | int(func, 16)
    rid += offset + stride * index
    return f"{domain}:{(rid >> 8) & 0xFF:02x}:{(rid >> 3) & 0x1F:02x}.{rid & 7}"


def net_interface(
    tree: FakeTree,
    device_path: str,
    ifname: str,
    *,
    link_type: int = ARPHRD_ETHER,
    operstate: str = "up",
    carrier: Optional[int] = 1,
    mac: str = "",
    phys_port_name: Optional[str] = None,
    ifindex: Optional[int] = None,
) -> str:
    """``<device>/net/<ifname>`` plus the ``/sys/class/net`` link; returns the interface dir.
    ``carrier=None`` leaves it out, as the kernel refuses to read it on an admin-down link."""
    base = f"{device_path}/net/{ifname}"
    tree.attr(f"{base}/type", str(link_type))
    tree.attr(f"{base}/operstate", operstate)
    if carrier is not None:
        tree.attr(f"{base}/carrier", str(carrier))
    if link_type == ARPHRD_INFINIBAND:
        tree.attr(
            f"{base}/address", mac or "00:00:10:87:fe:80:00:00:00:00:00:00:0c:42:a1:03:00:5e:1a:60"
        )
    else:
        tree.attr(f"{base}/address", mac or "b4:96:91:00:00:01")
    if phys_port_name is not None:
        tree.attr(f"{base}/phys_port_name", phys_port_name)
    if ifindex is not None:
        tree.attr(f"{base}/ifindex", str(ifindex))
    tree.link(f"{base}/device", device_path)
    tree.link(f"/sys/class/net/{ifname}", base)
    return base


@dataclass
class SriovPf:
    address: str
    path: str
    ifname: Optional[str]
    vf_addresses: List[str] = field(default_factory=list)
    vf_paths: List[str] = field(default_factory=list)
    vf_groups: List[Optional[int]] = field(default_factory=list)

    def vf_link(self, index: int) -> str:
        return f"{self.path}/virtfn{index}"


def vfio_cdev(tree: FakeTree, function_path: str, index: int, *, dev_node: bool = True,
              iommu_node: bool = True) -> str:
    """The vfio device cdev of a vfio-bound function (CONFIG_VFIO_DEVICE_CDEV, 6.6+): class
    "vfio-dev" device ``vfioN`` under the function (drivers/vfio/vfio_main.c: parent = the
    function, /sys/class/vfio-dev/vfioN), its node /dev/vfio/devices/vfioN
    (drivers/vfio/device_cdev.c devnode), and the iommufd misc node /dev/iommu. N is vfio's own
    device index (an IDA over every vfio device, in bind order), not the IOMMU group. Returns
    the /dev path of the cdev."""
    base = f"{function_path}/vfio-dev/vfio{index}"
    tree.attr(f"{base}/dev", f"{VFIO_CDEV_MAJOR}:{index}")
    tree.attr(f"{base}/uevent",
              f"MAJOR={VFIO_CDEV_MAJOR}\nMINOR={index}\nDEVNAME=vfio/devices/vfio{index}")
    tree.link(f"{base}/device", function_path)
    tree.link(f"/sys/class/vfio-dev/vfio{index}", base)
    if iommu_node:
        tree.chardev("/dev/iommu", MISC_MAJOR, 123)
    node = f"/dev/vfio/devices/vfio{index}"
    if dev_node:
        tree.chardev(node, VFIO_CDEV_MAJOR, index)
    return node


def vfio_nodes(tree: FakeTree, group: int, minor: int = 0) -> str:
    """/dev/vfio/vfio and /dev/vfio/<group>; returns the group node's path."""
    tree.chardev("/dev/vfio/vfio", MISC_MAJOR, 196)
    return tree.chardev(f"/dev/vfio/{group}", VFIO_MAJOR, minor)


def sriov_pf(
    tree: FakeTree,
    address: str,
    *,
    vendor: int = 0x8086,
    device: int = 0x1592,
    vf_device: int = 0x1889,
    pci_class: int = 0x020000,
    numvfs: int = 4,
    totalvfs: Optional[int] = None,
    driver: Optional[str] = "ice",
    vf_driver: Optional[str] = "iavf",
    vfio: Collection[int] = (),
    unbound: Collection[int] = (),
    ifname: Optional[str] = "ens1f0",
    vf_ifname: Optional[str] = "{pf}v{index}",
    link_type: int = ARPHRD_ETHER,
    operstate: str = "up",
    carrier: Optional[int] = 1,
    numa_node: Optional[int] = 0,
    vf_numa_node: Optional[int] = -2,
    local_cpulist: Optional[str] = None,
    parent: Optional[str] = None,
    iommu_group: Optional[int] = None,
    vf_iommu_group: Optional[int] = None,
    vf_offset: int = 8,
    vf_stride: int = 1,
    dev_nodes: bool = True,
) -> SriovPf:
    """A PF with ``numvfs`` VFs. VFs in ``vfio`` are on vfio-pci (group nodes created unless
    ``dev_nodes`` is False), those in ``unbound`` on no driver, the rest on ``vf_driver``
    with a netdev named from ``vf_ifname``. VF groups count up from ``vf_iommu_group``
    (None: no IOMMU groups at all). ``vf_numa_node=-2`` copies the PF's, as the kernel does."""
    path = tree.pci_function(
        address,
        vendor=vendor,
        device=device,
        pci_class=pci_class,
        numa_node=numa_node,
        driver=driver,
        iommu_group=iommu_group,
        parent=parent,
        local_cpulist=local_cpulist,
        extra={
            "sriov_numvfs": str(numvfs),
            "sriov_totalvfs": str(totalvfs if totalvfs is not None else max(numvfs, 8)),
            "sriov_offset": str(vf_offset),
            "sriov_stride": str(vf_stride),
            "sriov_vf_device": f"{vf_device:04x}",
            "sriov_drivers_autoprobe": "1",
        },
    )
    if ifname:
        _, bus, rest = address.split(":")
        slot, func = rest.split(".")
        net_interface(
            tree,
            path,
            ifname,
            link_type=link_type,
            operstate=operstate,
            carrier=carrier,
            mac=f"b4:96:91:{bus}:{slot}:{int(func):02x}",
        )
    pf = SriovPf(address=address, path=path, ifname=ifname)
    parent_dir = path.rsplit("/", 1)[0]
    for index in range(numvfs):
        vf = vf_address(address, vf_offset, vf_stride, index)
        group = None if vf_iommu_group is None else vf_iommu_group + index
        driver_name: Optional[str] = vf_driver
        if index in vfio:
            driver_name = "vfio-pci"
        elif index in unbound:
            driver_name = None
        vf_path = tree.pci_function(
            vf,
            vendor=vendor,
            device=vf_device,
            pci_class=pci_class,
            numa_node=numa_node if vf_numa_node == -2 else vf_numa_node,
            driver=driver_name,
            iommu_group=group,
            parent=parent_dir,
            local_cpulist=local_cpulist,
        )
        tree.link(f"{vf_path}/physfn", path)
        tree.link(f"{path}/virtfn{index}", vf_path)
        if driver_name == "vfio-pci":
            if dev_nodes and group is not None:
                vfio_nodes(tree, group, index)
        elif driver_name and vf_ifname and ifname is not None:
            net_interface(
                tree,
                vf_path,
                vf_ifname.format(pf=ifname, index=index),
                link_type=link_type,
                mac=f"02:00:00:00:{int(address.split(':')[1], 16):02x}:{index:02x}",
            )
        pf.vf_addresses.append(vf)
        pf.vf_paths.append(vf_path)
        pf.vf_groups.append(group)
    return pf


# -- RDMA ------------------------------------------------------------------------------------
@dataclass
class RdmaDevice:
    name: str
    path: str  # <parent>/infiniband/<name>
    parent: str
    uverbs: Optional[str] = None  # /dev/infiniband/uverbsN
    uverbs_class: Optional[str] = None  # <parent>/infiniband_verbs/uverbsN
    umad: List[str] = field(default_factory=list)  # /dev/infiniband/umadN
    umad_class: List[str] = field(default_factory=list)


def _class_device(
    tree: FakeTree, parent: str, cls: str, name: str, major: int, minor: int, dev_node: bool
) -> str:
    base = f"{parent}/{cls}/{name}"
    tree.attr(f"{base}/dev", f"{major}:{minor}")
    tree.attr(f"{base}/uevent", f"MAJOR={major}\nMINOR={minor}\nDEVNAME=infiniband/{name}")
    tree.link(f"{base}/device", parent)
    tree.link(f"/sys/class/{cls}/{name}", base)
    if dev_node:
        tree.chardev(f"/dev/infiniband/{name}", major, minor)
    return base


def rdma_device(
    tree: FakeTree,
    parent: str,
    name: str,
    *,
    link_layers: Sequence[str] = ("InfiniBand",),
    state: str = "4: ACTIVE",
    phys_state: str = "5: LinkUp",
    uverbs: Optional[int] = 0,
    umad: Optional[int] = None,
    node_guid: str = "0c42:a103:005e:1a60",
    dev_nodes: bool = True,
) -> RdmaDevice:
    """An RDMA device under ``parent`` (a PCI function or an auxiliary device), one port per
    entry of ``link_layers``; ``uverbsN`` when ``uverbs`` is a number, and from ``umad`` on
    one ``umadN``/``issmN`` per port (None: no MAD devices, as for iWARP)."""
    path = f"{parent}/infiniband/{name}"
    tree.attr(f"{path}/node_guid", node_guid)
    tree.attr(f"{path}/node_type", "1: CA")
    tree.attr(f"{path}/fw_ver", "28.39.1002")
    tree.link(f"{path}/device", parent)
    for number, layer in enumerate(link_layers, 1):
        tree.attr(f"{path}/ports/{number}/link_layer", layer)
        tree.attr(f"{path}/ports/{number}/state", state)
        tree.attr(f"{path}/ports/{number}/phys_state", phys_state)
    tree.link(f"/sys/class/infiniband/{name}", path)
    device = RdmaDevice(name=name, path=path, parent=parent)
    if uverbs is not None:
        tree.attr("/sys/class/infiniband_verbs/abi_version", "6")
        base = _class_device(
            tree,
            parent,
            "infiniband_verbs",
            f"uverbs{uverbs}",
            UVERBS_MAJOR,
            192 + uverbs,
            dev_nodes,
        )
        tree.attr(f"{base}/ibdev", name)
        device.uverbs = f"/dev/infiniband/uverbs{uverbs}"
        device.uverbs_class = base
    if umad is not None:
        tree.attr("/sys/class/infiniband_mad/abi_version", "5")
        for offset, _ in enumerate(link_layers):
            number = umad + offset
            for prefix, minor in (("umad", number), ("issm", 64 + number)):
                base = _class_device(
                    tree,
                    parent,
                    "infiniband_mad",
                    f"{prefix}{number}",
                    UVERBS_MAJOR,
                    minor,
                    dev_nodes,
                )
                tree.attr(f"{base}/ibdev", name)
                tree.attr(f"{base}/port", str(offset + 1))
                if prefix == "umad":
                    device.umad.append(f"/dev/infiniband/umad{number}")
                    device.umad_class.append(base)
    return device


def rdma_cm(tree: FakeTree, *, dev_node: bool = True, minor: int = 58) -> str:
    """The one rdma_cm misc device (rdma_ucm loaded); returns its /dev path."""
    base = "/sys/devices/virtual/misc/rdma_cm"
    tree.attr(f"{base}/dev", f"{MISC_MAJOR}:{minor}")
    tree.attr(f"{base}/uevent", f"MAJOR={MISC_MAJOR}\nMINOR={minor}\nDEVNAME=infiniband/rdma_cm")
    tree.link("/sys/class/misc/rdma_cm", base)
    if dev_node:
        tree.chardev("/dev/infiniband/rdma_cm", MISC_MAJOR, minor)
    return "/dev/infiniband/rdma_cm"


def mellanox_hca(
    tree: FakeTree,
    address: str,
    name: str,
    *,
    device: int = 0x1021,
    numa_node: Optional[int] = 0,
    parent: Optional[str] = None,
    iommu_group: Optional[int] = None,
    ifname: Optional[str] = None,
    link_layers: Sequence[str] = ("InfiniBand",),
    uverbs: Optional[int] = 0,
    umad: Optional[int] = 0,
    dev_nodes: bool = True,
    node_guid: str = "0c42:a103:005e:1a60",
) -> RdmaDevice:
    """A ConnectX function on mlx5_core with its RDMA device; an Ethernet port gets a netdev
    of type ether, an InfiniBand one an IPoIB netdev of type infiniband when ``ifname``."""
    path = tree.pci_function(
        address,
        vendor=0x15B3,
        device=device,
        pci_class=0x020700 if link_layers[0] == "InfiniBand" else 0x020000,
        numa_node=numa_node,
        driver="mlx5_core",
        iommu_group=iommu_group,
        parent=parent,
    )
    if ifname:
        kind = ARPHRD_INFINIBAND if link_layers[0] == "InfiniBand" else ARPHRD_ETHER
        net_interface(tree, path, ifname, link_type=kind)
    return rdma_device(
        tree,
        path,
        name,
        link_layers=link_layers,
        uverbs=uverbs,
        umad=umad,
        dev_nodes=dev_nodes,
        node_guid=node_guid,
    )
