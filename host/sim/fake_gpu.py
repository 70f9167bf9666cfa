"""GPUs for fake trees, in the shapes their kernel drivers leave behind.

NVIDIA: the PCI function bound to ``nvidia``, /proc/driver/nvidia/gpus/<addr>/information in the
format nv-procfs.c prints (``"Key: \\t value"``), /dev/nvidiaN (major 195) and the control
nodes. AMD and Intel: the function bound to amdgpu / i915 / xe with ``drm/cardN`` and
``drm/renderDN`` folders under it (each with its ``dev`` numbers), the /sys/class/drm links and
/dev/dri nodes (major 226); AMD adds /dev/kfd, Intel the /dev/dri/by-path links udev makes.
Every piece can be left out to build the odd cases (driver not loaded, node not created).

The three vendors' layouts and the AMD partition/KFD shapes are here, as the gpu driver
reads them all.
"""

from __future__ import annotations

import hashlib
from typing import Any, Dict, Optional

from host.sim.tree import FakeTree

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


# -- AMD compute partitions and the KFD topology --------------------------------------------------
#
# Where each detail comes from (torvalds/linux, drivers/gpu/drm/amd):
# * amdxcp/amdgpu_xcp_drv.c: every partition after the first is a DRM device of its own on a
#   platform device registered as platform_device_register_simple("amdgpu_xcp", n): sysfs names
#   it /sys/devices/platform/amdgpu_xcp.<n>, with <n> a counter over all GPUs of the machine.
# * amdgpu/amdgpu_xcp.c (amdgpu_xcp_dev_alloc): partition 0 reuses the PCI function's own DRM
#   device; the other MAX_XCP - 1 = 7 platform devices are allocated at probe *whatever the
#   mode*, so an SPX GPU still shows 7 idle render nodes. Only KFD tells which are live.
# * drm/drm_drv.c: a DRIVER_RENDER device gets a primary (cardN) and a render (renderDN) minor.
# * amdgpu/amdgpu_gfx.c: current_compute_partition prints "SPX"/"DPX"/"TPX"/"QPX"/"CPX",
#   available_compute_partition a comma-separated list ("SPX, DPX, QPX, CPX");
#   amdgpu/amdgpu_gmc.c: current_memory_partition "NPS1"/"NPS4", available_memory_partition.
#   amdgpu/amdgpu_device.c: mem_info_vram_total in bytes.
# * amdkfd/kfd_topology.c: /sys/class/kfd/kfd/topology/nodes/<n>/{gpu_id,name,properties},
#   properties as "<key> <value>" lines; node 0.. are CPU nodes (gpu_id 0, simd_count 0);
#   location_id = pci_dev_id (bus << 8 | devfn), on multi-partition devices OR-ed with the
#   partition (node) id in its low bits: kfd_topology_add_device has
#   "if (gpu->kfd->num_nodes > 1) location_id |= dev->gpu->node_id" (ROCm/amdgpu, and mainline
#   since the bits-31:28 form of commit 925c7bd1d1cf was reverted: RCCL was not ready for it).
#   So partition k of a GPU at bb:00.0 reads as bb:00.k. ``partition_bits="high"`` builds the
#   short-lived bits-31:28 form instead; domain = the PCI domain; drm_render_minor = the
#   partition's render minor. io_links/<m>/properties: type (2 PCIe, 11 XGMI: kfd_crat.h
#   CRAT_IOLINK_TYPE_*), node_from, node_to, weight (PCIe 20, XGMI 15 per hop: kfd_crat.c).
#   topology/generation_id shows sys_props.generation_count, incremented on every add, remove
#   or update of a node.
# * /dev/kfd: one character device for the whole machine (major assigned at load).

XCP_PER_GPU = 8  # MAX_XCP in amdgpu_xcp.h
_KFD = "/sys/devices/virtual/kfd/kfd"
_PARTITIONS = {"SPX": 1, "DPX": 2, "TPX": 3, "QPX": 4, "CPX": 8}  # on an 8-XCD MI300X


class AmdMachine:
    """Allocates DRM minors, xcp platform devices and KFD nodes the way a real boot does:
    GPUs probe in order, each takes 8 consecutive card and render minors (its own + 7 xcp)."""

    def __init__(
        self, tree: FakeTree, *, first_card: int = 1, cpu_nodes: int = 1,
        partition_bits: str = "low",
    ) -> None:
        self.tree = tree
        self.partition_bits = partition_bits  # "low": today's kernels; "high": bits 31:28
        self.next_card = first_card
        self.next_render = 128
        self.next_xcp = 0
        self.cpu_nodes = cpu_nodes
        self.generation = 0  # kfd_topology.c's generation_count, bumped on every rebuild
        self.gpus: list = []  # (address, function path, [(card, render, drm dir)], numa)
        self.hives: dict = {}
        tree.link("/sys/class/kfd/kfd", _KFD)
        tree.attr(f"{_KFD}/dev", "237:0")
        tree.chardev("/dev/kfd", 237, 0)

    def add_gpu(
        self,
        address: str,
        *,
        numa_node: int = 0,
        compute: str = "SPX",
        memory: str = "NPS1",
        available: str = "SPX, DPX, QPX, CPX",
        available_memory: str = "NPS1, NPS4",
        vram_bytes: int = 206_141_652_992,  # 192 GiB HBM3 less the driver's reserve
        parent: Optional[str] = None,
        hive: Optional[int] = 0x5E1F7A31C0DE0001,
        product_name: str = "AMD Instinct MI300X",
        render_nodes: bool = True,
    ) -> str:
        """An MI300X (1002:74a1, class 0x120000) with its partition attributes, its own DRM
        minors and its 7 xcp platform devices. ``write_kfd`` adds the topology afterwards."""
        tree = self.tree
        path = tree.pci_function(
            address, vendor=0x1002, device=0x74A1, pci_class=0x120000, numa_node=numa_node,
            driver="amdgpu", parent=parent, subsystem_device=0x74A1,
        )
        tree.attr(f"{path}/product_name", product_name)
        tree.attr(f"{path}/current_compute_partition", compute)
        tree.attr(f"{path}/available_compute_partition", available)
        tree.attr(f"{path}/current_memory_partition", memory)
        tree.attr(f"{path}/available_memory_partition", available_memory)
        tree.attr(f"{path}/mem_info_vram_total", str(vram_bytes))
        minors = []
        for index in range(XCP_PER_GPU):
            card, render = self.next_card, self.next_render
            self.next_card += 1
            self.next_render += 1
            if index == 0:
                owner = path
            else:
                owner = f"/sys/devices/platform/amdgpu_xcp.{self.next_xcp}"
                self.next_xcp += 1
                tree.link(f"{owner}/subsystem", "/sys/bus/platform")
                tree.attr(f"{owner}/uevent", "")
                tree.link(f"/sys/bus/platform/devices/{owner.rsplit('/', 1)[1]}", owner)
            if render_nodes or index == 0:
                add_drm(tree, owner, card=card, render=render)
            minors.append((card, render, owner))
        self.gpus.append((address, path, minors, numa_node, compute, memory, vram_bytes, hive))
        return path

    def set_partition(self, address: str, compute: str, memory: Optional[str] = None) -> None:
        """What a write to current_compute_partition leaves behind: the new mode in sysfs and
        a rebuilt KFD topology (the xcp platform devices and their nodes stay)."""
        for number, entry in enumerate(self.gpus):
            if entry[0] == address:
                path = entry[1]
                self.tree.attr(f"{path}/current_compute_partition", compute)
                if memory is not None:
                    self.tree.attr(f"{path}/current_memory_partition", memory)
                self.gpus[number] = (*entry[:4], compute, memory or entry[5], *entry[6:])
        self.write_kfd()

    def write_kfd(self) -> None:
        """The KFD topology for the current modes: CPU nodes first, then one node per live
        partition in GPU probe order; XGMI links between every pair of partitions in a hive."""
        tree = self.tree
        tree.remove(f"{_KFD}/topology")
        self.generation += 1
        tree.attr(f"{_KFD}/topology/generation_id", str(self.generation))
        tree.attr(f"{_KFD}/topology/system_properties", "platform_oem 0\nplatform_id 0\n"
                  "platform_rev 0\n")
        nodes: list = []  # (node id, properties dict or None for a CPU, hive, numa)
        for cpu in range(self.cpu_nodes):
            nodes.append((cpu, None, None, cpu))
        for address, _path, minors, numa, compute, _memory, vram, hive in self.gpus:
            count = _PARTITIONS.get(compute.upper(), 1)
            domain, bus, rest = address.split(":")
            slot, func = rest.split(".")
            pci_id = int(bus, 16) << 8 | int(slot, 16) << 3 | int(func)
            for index in range(count):
                if count == 1:
                    location = pci_id
                elif self.partition_bits == "high":
                    location = pci_id | (index << 28)
                else:
                    location = pci_id | index
                props: Dict[str, Any] = {
                    "cpu_cores_count": 0, "simd_count": 304 // count, "mem_banks_count": 1,
                    "caches_count": 0, "io_links_count": 0, "p2p_links_count": 0,
                    "cpu_core_id_base": 0, "simd_id_base": 2147487744 + len(nodes) * 1024,
                    "max_waves_per_simd": 8, "lds_size_in_kb": 64, "gds_size_in_kb": 0,
                    "num_gws": 64, "wave_front_size": 64, "array_count": 32 // count,
                    "simd_arrays_per_engine": 1, "cu_per_simd_array": 10, "simd_per_cu": 4,
                    "max_slots_scratch_cu": 32, "gfx_target_version": 90402,
                    "vendor_id": 4098, "device_id": 29857, "location_id": location,
                    "domain": int(domain, 16), "drm_render_minor": minors[index][1],
                    "hive_id": hive or 0, "num_sdma_engines": 2, "num_sdma_xgmi_engines": 6,
                    "num_sdma_queues_per_engine": 8, "num_cp_queues": 24,
                    "max_engine_clk_fcompute": 2100, "local_mem_size": 0,
                    "fw_version": 155, "capability": 1013983872, "sdma_fw_version": 19,
                    "unique_id": 0x1A2B3C4D00000000 + pci_id, "num_xcc": 8 // count,
                    "max_engine_clk_ccompute": 3700, "mem_bytes": vram // count,
                }
                nodes.append((len(nodes), props, hive, numa))
        for node, props, hive, numa in nodes:
            base = f"{_KFD}/topology/nodes/{node}"
            links = []
            if props is None:
                tree.attr(f"{base}/gpu_id", "0")
                tree.attr(f"{base}/name", "")
                tree.attr(f"{base}/properties", "cpu_cores_count 96\nsimd_count 0\n"
                          "mem_banks_count 1\ncaches_count 0\nio_links_count 0\n"
                          "location_id 0\ndomain 0\ndrm_render_minor 0\nhive_id 0\n")
                continue
            links.append((2, numa, 20))  # to its CPU node over PCIe
            if hive:
                for peer, peer_props, peer_hive, _ in nodes:
                    if peer != node and peer_props is not None and peer_hive == hive:
                        links.append((11, peer, 15))
            props = dict(props)
            mem = props.pop("mem_bytes")
            props["io_links_count"] = len(links)
            tree.attr(f"{base}/gpu_id", str(10000 + node * 37))
            tree.attr(f"{base}/name", "ip_discovery")
            tree.attr(f"{base}/properties",
                      "".join(f"{key} {value}\n" for key, value in props.items()))
            tree.attr(f"{base}/mem_banks/0/properties",
                      f"heap_type 1\nsize_in_bytes {mem}\nflags 0\nwidth 64\n"
                      "mem_clk_max 1300\n")
            for number, (kind, to, weight) in enumerate(links):
                tree.attr(f"{base}/io_links/{number}/properties",
                          f"type {kind}\nversion_major 0\nversion_minor 0\nnode_from {node}\n"
                          f"node_to {to}\nweight {weight}\nmin_latency 0\nmax_latency 0\n"
                          f"min_bandwidth {312 if kind == 11 else 0}\n"
                          f"max_bandwidth {64000 if kind == 11 else 0}\n"
                          "recommended_transfer_size 0\nrecommended_sdma_engine_id_mask 0\n"
                          "flags 1\n")


# -- NVIDIA MIG ------------------------------------------------------------------------------------
#
# Where each detail comes from:
# * NVIDIA's open kernel modules, kernel-open/nvidia/nv-caps.c: capabilities are procfs files
#   under /proc/driver/nvidia/capabilities/, one "access" file each, printing
#   "DeviceFileMinor: <m>\nDeviceFileMode: <mode>\nDeviceFileModify: <0|1>\n"; MIG ones are
#   mig/config, mig/monitor and, per GPU by its *device minor*, gpu<N>/mig/gi<X>/access and
#   gpu<N>/mig/gi<X>/ci<Y>/access, present while that GPU / compute instance exists.
# * /proc/driver/nvidia-caps/mig-minors: the static table of every possible capability and the
#   minor of its /dev/nvidia-caps/nvidia-cap<m> node, one "<name> <minor>" a line (parsed by
#   nvidia-container-toolkit internal/nvcaps and Slurm's gpu_nvml.c): "config 1",
#   "monitor 2", then per GPU 0..31 and GI 0..14 "gpu<N>/gi<X>/access" followed by its eight
#   "gpu<N>/gi<X>/ci<Y>/access" lines, minors counting up from 3.
# * /dev/nvidia-caps/nvidia-cap<m>: created by nvidia-modprobe -f <access file> with the
#   "nvidia-caps" major from /proc/devices.

NVIDIA_CAPS_MAJOR = 508
MIG_CAPS = "/proc/driver/nvidia/capabilities"


def mig_minor(gpu: int, gi: Optional[int] = None, ci: Optional[int] = None) -> int:
    """The minor mig-minors assigns (see above)."""
    if gi is None:
        raise ValueError("a MIG capability needs a GPU instance")
    base = 3 + gpu * 15 * 9 + gi * 9
    return base if ci is None else base + 1 + ci


def add_mig_minors_table(tree: FakeTree, gpus: int = 32) -> None:
    lines = ["config 1", "monitor 2"]
    for gpu in range(gpus):
        for gi in range(15):
            lines.append(f"gpu{gpu}/gi{gi}/access {mig_minor(gpu, gi)}")
            for ci in range(8):
                lines.append(f"gpu{gpu}/gi{gi}/ci{ci}/access {mig_minor(gpu, gi, ci)}")
    tree.attr("/proc/driver/nvidia-caps/mig-minors", "\n".join(lines) + "\n")
    tree.attr("/proc/devices", f"Character devices:\n195 nvidia\n{NVIDIA_CAPS_MAJOR} "
              "nvidia-caps\n509 nvidia-uvm\n\nBlock devices:\n259 blkext\n")


def _access(minor: int, mode: int = 0o444) -> str:
    return f"DeviceFileMinor: {minor}\nDeviceFileMode: {mode}\nDeviceFileModify: 1\n"


def add_mig_config_caps(tree: FakeTree, dev_nodes: bool = True) -> None:
    tree.attr(f"{MIG_CAPS}/mig/config", _access(1, 0o400))
    tree.attr(f"{MIG_CAPS}/mig/monitor", _access(2, 0o444))
    if dev_nodes:
        tree.chardev("/dev/nvidia-caps/nvidia-cap1", NVIDIA_CAPS_MAJOR, 1)
        tree.chardev("/dev/nvidia-caps/nvidia-cap2", NVIDIA_CAPS_MAJOR, 2)


def add_mig_device(
    tree: FakeTree, gpu_minor: int, gi: int, ci: int = 0, *, dev_nodes: bool = True
) -> tuple:
    """One MIG device (GPU instance ``gi`` + compute instance ``ci``) on the GPU whose device
    minor is ``gpu_minor``; returns the (gi, ci) cap minors."""
    gi_minor, ci_minor = mig_minor(gpu_minor, gi), mig_minor(gpu_minor, gi, ci)
    base = f"{MIG_CAPS}/gpu{gpu_minor}/mig/gi{gi}"
    tree.attr(f"{base}/access", _access(gi_minor))
    tree.attr(f"{base}/ci{ci}/access", _access(ci_minor))
    if dev_nodes:
        tree.chardev(f"/dev/nvidia-caps/nvidia-cap{gi_minor}", NVIDIA_CAPS_MAJOR, gi_minor)
        tree.chardev(f"/dev/nvidia-caps/nvidia-cap{ci_minor}", NVIDIA_CAPS_MAJOR, ci_minor)
    return gi_minor, ci_minor


def golden_rows(rows: list) -> list:
    """``discover --json`` rows as the goldens keep them: why NVML is unavailable depends on
    the machine running discover (library missing, or present without a GPU), so only that it
    is, and what it would add, is compared."""
    for row in rows:
        note = row.get("attributes", {}).get("nvml", "")
        if note.startswith("not available: "):
            row["attributes"]["nvml"] = "not available: <reason>; " + note.rsplit("; ", 1)[1]
    return rows
