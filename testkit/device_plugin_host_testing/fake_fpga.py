"""FPGA cards for fake trees: Intel DFL cards (PAC Arria 10, N3000, D5005, OFS) and AMD/Xilinx
XRT cards (Alveo), in the shapes their kernel drivers leave behind.

DFL (Documentation/fpga/dfl.rst): dfl-pci binds the PCI function and registers a *base* FPGA
region under it, ``<fn>/fpga_region/regionN``, whose children are the platform devices
``dfl-fme.F`` (management engine, PF only) and ``dfl-port.P`` (one per accelerator port, with
``afu_id``, ``id`` and a ``dev``). The FME's partial-reconfiguration region is a second
fpga_region, ``dfl-fme.F/dfl-fme-region.P/fpga_region/regionM``, whose ``compat_id`` is the
FPGA interface id. Private features appear on the dfl bus as ``dfl_dev.N`` (``type``,
``feature_id``) under the FME or port. Nodes: /dev/dfl-fme.F, /dev/dfl-port.P.

XRT: two physical functions per card on one slot, the management PF bound to ``xclmgmt``
(sysfs ``mgmt_pf``, ``instance``; node /dev/xclmgmt<instance> with instance = domain << 16 |
bus << 8 | devfn, class dir ``xrt_mgmt``) and the user PF bound to ``xocl`` (``user_pf``,
``drm/renderD*`` and ``drm/cardN``; nodes /dev/dri/renderD*, /dev/dri/cardN).

Both card families' layouts (DFL, XRT) are here, as the fpga driver reads both.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from host.sim.tree import FakeTree

DFL_FME_MAJOR = 239
DFL_PORT_MAJOR = 238
XCLMGMT_MAJOR = 235
DRM_MAJOR = 226
PROCESSING_ACCELERATOR = 0x120000

NLB0_AFU = "d8424dc4a4a3c413f89e433683f9040b"
DCP12_INTERFACE = "69528db6eb31577a8c3668f9faa081f6"


@dataclass
class DflPortSpec:
    port: int  # the platform device number: dfl-port.<port>
    afu_id: Optional[str] = NLB0_AFU  # None leaves the file out
    port_id: Optional[int] = 0  # the ``id`` attribute, the port's index on its card
    dev_node: bool = True
    features: Sequence[Tuple[int, int]] = ()  # dfl bus devices: (dfl_dev number, feature_id)


@dataclass
class DflCard:
    function: str  # /sys/devices path of the PCI function
    region: str  # the base region's path
    fme: Optional[str] = None
    pr_regions: List[str] = field(default_factory=list)
    ports: Dict[int, str] = field(default_factory=dict)


def xrt_instance(address: str) -> int:
    """XRT's node number for a function (XOCL_DEV_ID): domain << 16 | bus << 8 | devfn."""
    domain, bus, rest = address.split(":")
    slot, func = rest.split(".")
    return (int(domain, 16) << 16) | (int(bus, 16) << 8) | (int(slot, 16) << 3) | int(func, 16)


def _platform_device(
    tree: FakeTree, path: str, name: str, driver: str, major: int, minor: int, dev_node: bool
) -> None:
    tree.attr(f"{path}/dev", f"{major}:{minor}")
    tree.attr(
        f"{path}/uevent",
        f"MAJOR={major}\nMINOR={minor}\nDEVNAME={name}\nDRIVER={driver}\n"
        f"MODALIAS=platform:{driver}",
    )
    tree.link(f"{path}/subsystem", "/sys/bus/platform")
    tree.bind_driver(path, driver, bus="platform")
    tree.link(f"/sys/bus/platform/devices/{name}", path)
    if dev_node:
        tree.chardev(f"/dev/{name}", major, minor)


def _dfl_bus_device(
    tree: FakeTree, parent: str, number: int, feature_type: int, feature_id: int
) -> None:
    path = f"{parent}/dfl_dev.{number}"
    tree.attr(f"{path}/type", f"0x{feature_type:x}")
    tree.attr(f"{path}/feature_id", f"0x{feature_id:x}")
    tree.attr(f"{path}/uevent", f"MODALIAS=dfl:t{feature_type:04X}f{feature_id:04X}")
    tree.link(f"{path}/subsystem", "/sys/bus/dfl")
    tree.link(f"/sys/bus/dfl/devices/dfl_dev.{number}", path)


def _region(tree: FakeTree, path: str, number: int) -> None:
    tree.mkdir(path)
    tree.link(f"{path}/subsystem", "/sys/class/fpga_region")
    tree.link(f"/sys/class/fpga_region/region{number}", path)


def dfl_card(
    tree: FakeTree,
    address: str,
    *,
    device: int = 0x09C4,
    numa_node: Optional[int] = -1,
    local_cpulist: Optional[str] = None,
    parent: Optional[str] = None,
    iommu_group: Optional[int] = None,
    region: int = 0,
    fme: Optional[int] = 0,
    pr_region: Optional[int] = None,
    interface_id: Optional[str] = DCP12_INTERFACE,
    ports: Sequence[DflPortSpec] = (DflPortSpec(0),),
    fme_features: Sequence[Tuple[int, int]] = (),
    fme_dev_node: bool = True,
    driver: Optional[str] = "dfl-pci",
    bitstream_id: str = "0x0100008012345678",
    sriov_totalvfs: Optional[int] = None,
    pr_ports: Optional[Sequence[int]] = None,
) -> DflCard:
    """A PF with a base region holding its FME (``fme=None`` leaves it out) and ports.

    ``pr_region`` numbers the FME's PR region (default ``region + 1``, the order the kernel
    registers them); ``interface_id=None`` leaves its ``compat_id`` out. The FME makes one PR
    region and bridge per port it manages, released ports (``pr_ports``, default: the ports'
    ids) included.
    """
    extra = {}
    if sriov_totalvfs is not None:
        extra = {"sriov_totalvfs": str(sriov_totalvfs), "sriov_numvfs": "0"}
    function = tree.pci_function(
        address,
        vendor=0x8086,
        device=device,
        pci_class=PROCESSING_ACCELERATOR,
        numa_node=numa_node,
        driver=driver,
        iommu_group=iommu_group,
        parent=parent,
        local_cpulist=local_cpulist,
        subsystem_vendor=0x8086,
        subsystem_device=0x0000,
        extra=extra,
    )
    base = f"{function}/fpga_region/region{region}"
    _region(tree, base, region)
    card = DflCard(function=function, region=base)
    if fme is not None:
        fme_path = f"{base}/dfl-fme.{fme}"
        _platform_device(
            tree, fme_path, f"dfl-fme.{fme}", "dfl-fme", DFL_FME_MAJOR, fme, fme_dev_node
        )
        tree.attr(f"{fme_path}/bitstream_id", bitstream_id)
        tree.attr(f"{fme_path}/bitstream_metadata", "0x1807172")
        managed = (
            pr_ports
            if pr_ports is not None
            else [spec.port_id if spec.port_id is not None else 0 for spec in ports]
        )
        tree.attr(f"{fme_path}/ports_num", str(len(managed)))
        tree.attr(f"{fme_path}/socket_id", "0")
        tree.attr(
            f"{fme_path}/dfl-fme-mgr.{fme}/fpga_manager/fpga{fme}/name", "DFL FME FPGA Manager"
        )
        tree.attr(f"{fme_path}/dfl-fme-mgr.{fme}/fpga_manager/fpga{fme}/state", "operating")
        number = region + 1 if pr_region is None else pr_region
        for port_index in managed:
            tree.attr(
                f"{fme_path}/dfl-fme-br.{port_index}/fpga_bridge/br{port_index}/state", "enabled"
            )
            pr = f"{fme_path}/dfl-fme-region.{port_index}/fpga_region/region{number}"
            _region(tree, pr, number)
            if interface_id is not None:
                tree.attr(f"{pr}/compat_id", interface_id)
            card.pr_regions.append(pr)
            number += 1
        for dev_number, feature_id in fme_features:
            _dfl_bus_device(tree, fme_path, dev_number, 0, feature_id)
        card.fme = fme_path
    for spec in ports:
        card.ports[spec.port] = dfl_port(tree, base, spec)
    return card


def dfl_port(tree: FakeTree, region_path: str, spec: DflPortSpec) -> str:
    path = f"{region_path}/dfl-port.{spec.port}"
    _platform_device(
        tree, path, f"dfl-port.{spec.port}", "dfl-port", DFL_PORT_MAJOR, spec.port, spec.dev_node
    )
    if spec.afu_id is not None:
        tree.attr(f"{path}/afu_id", spec.afu_id)
    if spec.port_id is not None:
        tree.attr(f"{path}/id", str(spec.port_id))
    tree.attr(f"{path}/power_state", "0")
    for dev_number, feature_id in spec.features:
        _dfl_bus_device(tree, path, dev_number, 1, feature_id)
    return path


def dfl_vf(
    tree: FakeTree,
    pf: DflCard,
    address: str,
    *,
    device: int = 0x09C5,
    region: int,
    port: DflPortSpec,
    numa_node: Optional[int] = -1,
    vf_index: int = 0,
) -> DflCard:
    """A VF holding a port the FME released from the PF: its own base region, no FME."""
    parent = pf.function.rsplit("/", 1)[0]
    function = tree.pci_function(
        address,
        vendor=0x8086,
        device=device,
        pci_class=PROCESSING_ACCELERATOR,
        numa_node=numa_node,
        driver="dfl-pci",
        parent=parent,
    )
    tree.link(f"{function}/physfn", pf.function)
    tree.link(f"{pf.function}/virtfn{vf_index}", function)
    tree.attr(f"{pf.function}/sriov_numvfs", str(vf_index + 1))
    base = f"{function}/fpga_region/region{region}"
    _region(tree, base, region)
    card = DflCard(function=function, region=base)
    card.ports[port.port] = dfl_port(tree, base, port)
    return card


@dataclass
class XrtCard:
    mgmt: Optional[str]
    user: Optional[str]
    mgmt_node: Optional[str]
    render_node: Optional[str]


def xrt_card(
    tree: FakeTree,
    slot: str,
    *,
    mgmt_device: int = 0x5004,
    user_device: int = 0x5005,
    vendor: int = 0x10EE,
    numa_node: Optional[int] = -1,
    local_cpulist: Optional[str] = None,
    parent: Optional[str] = None,
    render_minor: int = 128,
    card_minor: int = 1,
    shell: Optional[str] = "xilinx_u250_gen3x16_xdma_shell_4_1",
    timestamp: str = "0x000000005fca3f28",
    serial: Optional[str] = "XFL1RT5PHT31",
    mgmt: bool = True,
    user: bool = True,
    markers: bool = True,
    instance_file: bool = True,
    mgmt_class_dir: bool = True,
    drm: bool = True,
    mgmt_driver: Optional[str] = "xclmgmt",
    user_driver: Optional[str] = "xocl",
    mgmt_dev_node: bool = True,
    render_dev_node: bool = True,
    iommu_groups: Tuple[Optional[int], Optional[int]] = (None, None),
    mgmt_minor: int = 0,
    mgmt_function: int = 0,
    user_function: int = 1,
) -> XrtCard:
    """An Alveo-style card at ``slot`` ("0000:d8:00"): mgmt PF .0, user PF .1 (XRT >= 2018.3;
    swap ``mgmt_function``/``user_function`` for older shells). ``markers=False`` leaves out
    ``mgmt_pf``/``user_pf`` (older XRT), ``instance_file`` / ``mgmt_class_dir`` the two other
    ways to learn the mgmt node's number."""
    out = XrtCard(None, None, None, None)
    if mgmt:
        address = f"{slot}.{mgmt_function}"
        path = tree.pci_function(
            address,
            vendor=vendor,
            device=mgmt_device,
            pci_class=PROCESSING_ACCELERATOR,
            numa_node=numa_node,
            driver=mgmt_driver,
            parent=parent,
            local_cpulist=local_cpulist,
            iommu_group=iommu_groups[0],
            subsystem_vendor=vendor,
            subsystem_device=0x000E,
        )
        instance = xrt_instance(address)
        if markers:
            tree.attr(f"{path}/mgmt_pf", "")
        if instance_file:
            tree.attr(f"{path}/instance", str(instance))
        name = f"xclmgmt{instance}"
        if mgmt_class_dir:
            node = f"{path}/xrt_mgmt/{name}"
            tree.attr(f"{node}/dev", f"{XCLMGMT_MAJOR}:{mgmt_minor}")
            tree.attr(
                f"{node}/uevent", f"MAJOR={XCLMGMT_MAJOR}\nMINOR={mgmt_minor}\nDEVNAME={name}"
            )
        if mgmt_dev_node:
            tree.chardev(f"/dev/{name}", XCLMGMT_MAJOR, mgmt_minor)
        if shell is not None:
            tree.attr(f"{path}/rom.m.{instance}/VBNV", shell)
            tree.attr(f"{path}/rom.m.{instance}/timestamp", timestamp)
        if serial is not None:
            tree.attr(f"{path}/xmc.m.{instance}/serial_num", serial)
        out.mgmt = path
        out.mgmt_node = f"/dev/{name}"
    if user:
        address = f"{slot}.{user_function}"
        path = tree.pci_function(
            address,
            vendor=vendor,
            device=user_device,
            pci_class=PROCESSING_ACCELERATOR,
            numa_node=numa_node,
            driver=user_driver,
            parent=parent,
            local_cpulist=local_cpulist,
            iommu_group=iommu_groups[1],
            subsystem_vendor=vendor,
            subsystem_device=0x000E,
        )
        instance = xrt_instance(address)
        if markers:
            tree.attr(f"{path}/user_pf", "")
        if shell is not None:
            tree.attr(f"{path}/rom.u.{instance}/VBNV", shell)
            tree.attr(f"{path}/rom.u.{instance}/timestamp", timestamp)
        if drm:
            for name, minor in (
                (f"card{card_minor}", card_minor),
                (f"renderD{render_minor}", render_minor),
            ):
                node = f"{path}/drm/{name}"
                tree.attr(f"{node}/dev", f"{DRM_MAJOR}:{minor}")
                tree.attr(
                    f"{node}/uevent",
                    f"MAJOR={DRM_MAJOR}\nMINOR={minor}\nDEVNAME=dri/{name}\nDEVTYPE=drm_minor",
                )
                tree.link(f"/sys/class/drm/{name}", node)
                if render_dev_node or name.startswith("card"):
                    tree.chardev(f"/dev/dri/{name}", DRM_MAJOR, minor)
            out.render_node = f"/dev/dri/renderD{render_minor}"
        out.user = path
    return out
