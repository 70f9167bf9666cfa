"""GPUs for fake trees, in the shapes their kernel drivers leave behind.

NVIDIA: the PCI function bound to ``nvidia``, /proc/driver/nvidia/gpus/<addr>/information in the
format nv-procfs.c prints (``"Key: \\t value"``), /dev/nvidiaN (major 195) and the control
nodes. AMD and Intel: the function bound to amdgpu / i915 / xe with ``drm/cardN`` and
``drm/renderDN`` folders under it (each with its ``dev`` numbers), the /sys/class/drm links and
/dev/dri nodes (major 226); AMD adds /dev/kfd, Intel the /dev/dri/by-path links udev makes.
Every piece can be left out to build the odd cases (driver not loaded, node not created).
"""

from __future__ import annotations

import hashlib
from typing import Optional

from host.testing.tree import FakeTree

NVIDIA_MAJOR = 195
DRM_MAJOR = 226


def gpu_uuid(address: str) -> str:
    """A stable, well-formed NVIDIA UUID for a PCI address (fixtures only)."""
    digest = hashlib.sha1(address.encode()).hexdigest()
    return f"GPU-{digest[:8]}-{digest[8:12]}-{digest[12:16]}-{digest[16:20]}-{digest[20:32]}"


def nvidia_information(
    address: str,
    minor: object,
    *,
    model: str = "NVIDIA H100 80GB HBM3",
    uuid: Optional[str] = "",
    vbios: str = "96.00.74.00.01",
    irq: int = 551,
    excluded: str = "No",
    firmware: Optional[str] = "535.129.03",
) -> str:
    """The information file as the driver prints it. ``uuid=None`` leaves the line out (the
    driver omits it when it has none); the default is ``gpu_uuid(address)``."""
    lines = [
        f"Model: \t\t {model}",
        f"IRQ:   \t\t {irq}",
    ]
    if uuid is not None:
        lines.append(f"GPU UUID: \t {uuid or gpu_uuid(address)}")
    lines += [
        f"Video BIOS: \t {vbios}",
        "Bus Type: \t PCIe",
        "DMA Size: \t 52 bits",
        "DMA Mask: \t 0xfffffffffffff",
        f"Bus Location: \t {address}",
        f"Device Minor: \t {minor}",
    ]
    if firmware:
        lines.append(f"GPU Firmware: \t {firmware}")
    lines.append(f"GPU Excluded:\t {excluded}")
    return "\n".join(lines) + "\n"


def add_nvidia_control_nodes(
    tree: FakeTree,
    *,
    ctl: bool = True,
    uvm: bool = True,
    uvm_tools: bool = True,
    modeset: bool = True,
) -> None:
    """/dev/nvidiactl (195:255), -modeset (195:254) and the UVM pair (a dynamic major)."""
    if ctl:
        tree.chardev("/dev/nvidiactl", NVIDIA_MAJOR, 255)
    if modeset:
        tree.chardev("/dev/nvidia-modeset", NVIDIA_MAJOR, 254)
    if uvm:
        tree.chardev("/dev/nvidia-uvm", 509, 0)
    if uvm_tools:
        tree.chardev("/dev/nvidia-uvm-tools", 509, 1)


def add_nvidia_gpu(
    tree: FakeTree,
    address: str,
    *,
    minor: Optional[int] = 0,
    device: int = 0x2330,
    pci_class: int = 0x030200,
    numa_node: Optional[int] = -1,
    driver: Optional[str] = "nvidia",
    information: Optional[str] = "",
    dev_node: bool = True,
    parent: Optional[str] = None,
    iommu_group: Optional[int] = None,
    local_cpulist: Optional[str] = None,
    **information_fields: object,
) -> str:
    """An NVIDIA GPU; returns its /sys/devices path.

    ``information`` is the file's text: "" builds it from ``minor`` and ``information_fields``
    (see nvidia_information), None leaves the file out (driver not loaded). ``dev_node`` creates
    /dev/nvidia<minor>.
    """
    path = tree.pci_function(
        address, vendor=0x10DE, device=device, pci_class=pci_class, numa_node=numa_node,
        driver=driver, parent=parent, iommu_group=iommu_group, local_cpulist=local_cpulist,
        subsystem_device=0x16C1,
    )
    if information == "" and driver == "nvidia":
        information = nvidia_information(address, minor, **information_fields)  # type: ignore[arg-type]
    if information:
        tree.attr(f"/proc/driver/nvidia/gpus/{address}/information", information)
    if dev_node and minor is not None:
        tree.chardev(f"/dev/nvidia{minor}", NVIDIA_MAJOR, minor)
    return path


def add_drm(
    tree: FakeTree,
    function_path: str,
    *,
    card: Optional[int] = None,
    render: Optional[int] = None,
    dev_nodes: bool = True,
    by_path: bool = False,
) -> None:
    """DRM minors under a PCI function, as drm_sysfs_device_add registers them."""
    address = function_path.rsplit("/", 1)[-1]
    for kind, number in (("card", card), ("renderD", render)):
        if number is None:
            continue
        name = f"{kind}{number}"
        folder = f"{function_path}/drm/{name}"
        tree.attr(f"{folder}/dev", f"{DRM_MAJOR}:{number}")
        tree.link(f"{folder}/device", function_path)
        tree.link(f"/sys/class/drm/{name}", folder)
        if dev_nodes:
            tree.chardev(f"/dev/dri/{name}", DRM_MAJOR, number)
        if by_path:
            suffix = "card" if kind == "card" else "render"
            tree.link(f"/dev/dri/by-path/pci-{address}-{suffix}", f"/dev/dri/{name}")


def add_amd_gpu(
    tree: FakeTree,
    address: str,
    *,
    card: Optional[int] = 1,
    render: Optional[int] = 128,
    device: int = 0x740F,
    pci_class: int = 0x038000,
    numa_node: Optional[int] = -1,
    driver: Optional[str] = "amdgpu",
    dev_nodes: bool = True,
    kfd: bool = True,
    parent: Optional[str] = None,
    iommu_group: Optional[int] = None,
    product_name: Optional[str] = "AMD Instinct MI210",
) -> str:
    """An AMD GPU (MI210, class 0x038000 by default; MI300X is 0x74a1 with class 0x120000)."""
    path = tree.pci_function(
        address, vendor=0x1002, device=device, pci_class=pci_class, numa_node=numa_node,
        driver=driver, parent=parent, iommu_group=iommu_group, subsystem_device=0x0C34,
    )
    if driver == "amdgpu":
        add_drm(tree, path, card=card, render=render, dev_nodes=dev_nodes)
        if product_name:
            tree.attr(f"{path}/product_name", product_name)
    if kfd:
        tree.chardev("/dev/kfd", 237, 0)
    return path


def add_intel_gpu(
    tree: FakeTree,
    address: str,
    *,
    card: Optional[int] = 1,
    render: Optional[int] = 128,
    device: int = 0x56C0,
    pci_class: int = 0x038000,
    numa_node: Optional[int] = -1,
    driver: Optional[str] = "i915",
    dev_nodes: bool = True,
    by_path: bool = True,
    parent: Optional[str] = None,
    iommu_group: Optional[int] = None,
) -> str:
    """An Intel GPU (Data Center GPU Flex 170 by default; an iGPU is 0000:00:02.0, 0x030000)."""
    path = tree.pci_function(
        address, vendor=0x8086, device=device, pci_class=pci_class, numa_node=numa_node,
        driver=driver, parent=parent, iommu_group=iommu_group,
    )
    if driver in ("i915", "xe"):
        add_drm(tree, path, card=card, render=render, dev_nodes=dev_nodes, by_path=by_path)
    return path
