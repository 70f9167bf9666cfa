"""Generate testkit/device_plugin_host_testing/machines/gpu-server-8x.tree: an HGX H100 8-GPU
server.

Modelled on a 2-socket Sapphire Rapids HGX H100 SXM5 system (Supermicro SYS-821GE class):

* GPUs at 18, 2a, 3a, 5d (NUMA 0) and 9a, ab, ba, db (NUMA 1), each behind a Broadcom PEX89xxx
  switch (1000:c030) whose other downstream port carries that GPU's rail NIC, a ConnectX-7
  (15b3:1021) in InfiniBand mode, at bus GPU+1. Each switch hangs off its own SPR root port in
  its own host bridge (pci0000:XX).
* The four NVSwitch (10de:22a3, class 0x068000, driver nvidia-nvswitch) at 07..0a:00.0 behind
  another switch on socket 0, as NVIDIA's HGX H100 topology example lists them; the ASPEED
  AST2600 BMC VGA (1a03:2000, ast, drm card0) at 02:00.0 behind its AST1150 PCIe-to-PCI bridge
  (no driver: pcieport binds PCIe ports only) on the PCH root port; one NVMe on socket 1 and
  the chipset host bridge, as noise.
* Driver 535.129.03: /proc/driver/nvidia/gpus/<addr>/information in nv-procfs.c's format,
  /dev/nvidia0..7 (195:N), nvidiactl, nvidia-modeset, nvidia-uvm(-tools), nvswitch nodes.
* RDMA as the kernel lays it out: infiniband/mlx5_N, infiniband_verbs/uverbsN and
  infiniband_mad/umadN + issmN under each NIC function, /sys/class links to them, rdma_cm as a
  misc device, /dev/infiniband nodes, and the IPoIB netdev ibp<bus>s0.

Run (from the repository root)::

    python tests/resources/gen_gpu_server_8x.py \
        > testkit/device_plugin_host_testing/machines/gpu-server-8x.tree
"""

from __future__ import annotations

import hashlib
import json
import posixpath
import sys
from typing import List, Optional

CPUS = {0: "0-55,112-167", 1: "56-111,168-223"}


def cpumask(cpulist: str, total: int = 224) -> str:
    """The kernel's local_cpus form of a cpulist: 32-bit hex words, most significant first."""
    mask = 0
    for part in cpulist.split(","):
        first, _, last = part.partition("-")
        for cpu in range(int(first), int(last or first) + 1):
            mask |= 1 << cpu
    words = [(mask >> (32 * i)) & 0xFFFFFFFF for i in range((total + 31) // 32)]
    return ",".join(f"{w:08x}" for w in reversed(words))


CPUMASK = {node: cpumask(cpus) for node, cpus in CPUS.items()}
GPU_BUSES = [0x18, 0x2A, 0x3A, 0x5D, 0x9A, 0xAB, 0xBA, 0xDB]
DRIVER_VERSION = "535.129.03"


class Tree:
    def __init__(self) -> None:
        self.lines: List[str] = []
        self.iommu = 0
        self.last_group = 0

    def d(self, path: str) -> None:
        self.lines.append(f"d {path}")

    def f(self, path: str, value: object) -> None:
        self.lines.append(f"f {path} {json.dumps(str(value))}")

    def l(self, path: str, target: str) -> None:  # noqa: E743 - mirrors the .tree kind
        if path.startswith("/sys/"):
            rel = sysfs_relative(posixpath.dirname(path), target)
        else:
            rel = posixpath.relpath(target, posixpath.dirname(path))  # udev's by-path links
        self.lines.append(f"l {path} -> {rel}")

    def c(self, path: str, major: int, minor: int) -> None:
        self.lines.append(f"c {path} {major}:{minor}")

    def comment(self, text: str) -> None:
        self.lines.append(f"# {text}")

    def pci(
        self,
        parent: str,
        address: str,
        vendor: int,
        device: int,
        pci_class: int,
        node: int,
        driver: Optional[str],
        *,
        sub_vendor: int = 0,
        sub_device: int = 0,
        speed: str = "32.0 GT/s PCIe",
        width: int = 16,
        revision: int = 0x00,
        iommu: bool = True,
        group: Optional[int] = None,
        irq: int = 0,
    ) -> str:
        path = f"{parent}/{address}"
        self.d(path)
        self.f(f"{path}/vendor", f"0x{vendor:04x}")
        self.f(f"{path}/device", f"0x{device:04x}")
        self.f(f"{path}/class", f"0x{pci_class:06x}")
        self.f(f"{path}/subsystem_vendor", f"0x{(sub_vendor or vendor):04x}")
        self.f(f"{path}/subsystem_device", f"0x{sub_device:04x}")
        self.f(f"{path}/revision", f"0x{revision:02x}")
        self.f(f"{path}/enable", "1")
        self.f(f"{path}/irq", str(irq))
        self.f(f"{path}/numa_node", str(node))
        self.f(f"{path}/local_cpulist", CPUS[node])
        self.f(f"{path}/local_cpus", CPUMASK[node])
        self.f(f"{path}/current_link_speed", speed)
        self.f(f"{path}/current_link_width", str(width))
        self.f(f"{path}/max_link_speed", speed)
        self.f(f"{path}/max_link_width", str(width))
        self.l(f"/sys/bus/pci/devices/{address}", path)
        if driver:
            self.l(f"{path}/driver", f"/sys/bus/pci/drivers/{driver}")
            self.l(f"/sys/bus/pci/drivers/{driver}/{address}", path)
        if iommu:
            if group is None:
                group = self.iommu
                self.iommu += 1
            self.last_group = group
            self.d(f"/sys/kernel/iommu_groups/{group}/devices")
            self.l(f"{path}/iommu_group", f"/sys/kernel/iommu_groups/{group}")
            self.l(f"/sys/kernel/iommu_groups/{group}/devices/{address}", path)
        return path

    def bridge(self, parent: str, address: str, device: int, node: int) -> str:
        return self.pci(parent, address, 0x8086, device, 0x060400, node, "pcieport", irq=0)


def sysfs_relative(link_dir: str, target: str) -> str:
    """The link text kernfs writes (kernfs_get_target_path): climb from the link's folder to
    the nearest folder holding the target's *parent*, then descend. A ``device`` link to the
    parent function thus reads ``../../../0000:19:00.0``, not ``../..``."""
    target_parent = posixpath.dirname(target)
    base = link_dir
    ups = 0
    while base != "/" and not (target_parent == base or target_parent.startswith(base + "/")):
        ups += 1
        base = posixpath.dirname(base)
    rest = target[len(base):].lstrip("/") if base != "/" else target.lstrip("/")
    return "../" * ups + rest


def uuid_for(address: str) -> str:
    h = hashlib.sha256(f"hgx-h100:{address}".encode()).hexdigest()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def guid_for(index: int) -> str:
    raw = f"a088c20300{0x4e + index:02x}{0x10 + 2 * index:02x}{0x3c + index:02x}"
    return ":".join(raw[i : i + 4] for i in range(0, 16, 4))


def information(address: str, minor: int, irq: int) -> str:
    return (
        "Model: \t\t NVIDIA H100 80GB HBM3\n"
        f"IRQ:   \t\t {irq}\n"
        f"GPU UUID: \t {uuid_for(address)}\n"
        "Video BIOS: \t 96.00.74.00.01\n"
        "Bus Type: \t PCIe\n"
        "DMA Size: \t 52 bits\n"
        "DMA Mask: \t 0xfffffffffffff\n"
        f"Bus Location: \t {address}\n"
        f"Device Minor: \t {minor}\n"
        f"GPU Firmware: \t {DRIVER_VERSION}\n"
        "GPU Excluded:\t No"
    )


def generate() -> List[str]:
    t = Tree()
    t.comment("gpu-server-8x: HGX H100 SXM5 8-GPU, 2x Xeon 8480+ (SPR), 8x ConnectX-7 NDR IB,")
    t.comment("4x NVSwitch, AST2600 BMC. NVIDIA driver " + DRIVER_VERSION + ", MLNX_OFED mlx5.")
    t.comment("Generated by tests/resources/gen_gpu_server_8x.py")

    t.comment("NUMA")
    for node in (0, 1):
        base = f"/sys/devices/system/node/node{node}"
        t.d(base)
        t.f(f"{base}/cpulist", CPUS[node])
    t.f("/sys/devices/system/node/possible", "0-1")
    t.f("/sys/devices/system/node/online", "0-1")
    t.f("/sys/devices/system/node/has_cpu", "0-1")
    t.f("/sys/devices/system/node/has_normal_memory", "0-1")

    t.comment("chipset, PCH root port, ASPEED BMC (bridge + VGA, drm card0)")
    t.pci("/sys/devices/pci0000:00", "0000:00:00.0", 0x8086, 0x09A2, 0x088000, 0, None,
          iommu=False, speed="Unknown", width=0)
    pch = t.bridge("/sys/devices/pci0000:00", "0000:00:1c.0", 0x1BB8, 0)
    ast_bridge = t.pci(pch, "0000:01:00.0", 0x1A03, 0x1150, 0x060400, 0, None,
                       speed="5.0 GT/s PCIe", width=1, revision=0x06)
    # Conventional PCI behind the AST bridge: bridge and VGA share one IOMMU group.
    vga = t.pci(ast_bridge, "0000:02:00.0", 0x1A03, 0x2000, 0x030000, 0, "ast",
                speed="5.0 GT/s PCIe", width=1, revision=0x52, irq=16, group=t.last_group)
    t.f(f"{vga}/boot_vga", "1")
    t.f(f"{vga}/drm/card0/dev", "226:0")
    t.l(f"{vga}/drm/card0/device", vga)
    t.l("/sys/class/drm/card0", f"{vga}/drm/card0")
    t.c("/dev/dri/card0", 226, 0)
    t.l("/dev/dri/by-path/pci-0000:02:00.0-card", "/dev/dri/card0")

    t.comment("NVSwitch x4 (class 0x068000) behind a PEX89xxx switch on socket 0")
    root = t.bridge("/sys/devices/pci0000:04", "0000:04:01.0", 0x352A, 0)
    up = t.pci(root, "0000:05:00.0", 0x1000, 0xC030, 0x060400, 0, "pcieport", revision=0xB0)
    for index in range(4):
        down = t.pci(up, f"0000:06:{index:02x}.0", 0x1000, 0xC030, 0x060400, 0, "pcieport",
                     revision=0xB0)
        sw = t.pci(down, f"0000:{0x07 + index:02x}:00.0", 0x10DE, 0x22A3, 0x068000, 0,
                   "nvidia-nvswitch", sub_device=0x1796, speed="16.0 GT/s PCIe", width=2,
                   revision=0xA1, irq=0)
        del sw
        t.c(f"/dev/nvidia-nvswitch{index}", 507, index)
    t.c("/dev/nvidia-nvswitchctl", 507, 255)

    t.comment("GPU + rail NIC pairs, each behind its own PEX89xxx switch")
    irq = 551
    for index, bus in enumerate(GPU_BUSES):
        node = 0 if index < 4 else 1
        root_bus = bus - 3
        host_bridge = f"/sys/devices/pci0000:{root_bus:02x}"
        root = t.bridge(host_bridge, f"0000:{root_bus:02x}:01.0", 0x352A, node)
        up = t.pci(root, f"0000:{bus - 2:02x}:00.0", 0x1000, 0xC030, 0x060400, node,
                   "pcieport", revision=0xB0)
        gpu_port = t.pci(up, f"0000:{bus - 1:02x}:00.0", 0x1000, 0xC030, 0x060400, node,
                         "pcieport", revision=0xB0)
        nic_port = t.pci(up, f"0000:{bus - 1:02x}:01.0", 0x1000, 0xC030, 0x060400, node,
                         "pcieport", revision=0xB0)
        gpu_addr = f"0000:{bus:02x}:00.0"
        t.pci(gpu_port, gpu_addr, 0x10DE, 0x2330, 0x030200, node, "nvidia",
              sub_device=0x16C1, revision=0xA1, irq=irq + index)
        t.f(f"/proc/driver/nvidia/gpus/{gpu_addr}/information",
            information(gpu_addr, index, irq + index))
        t.f(f"/proc/driver/nvidia/gpus/{gpu_addr}/power",
            "Runtime D3 status:          Disabled by default\nVideo Memory:               Active")
        t.c(f"/dev/nvidia{index}", 195, index)

        nic_addr = f"0000:{bus + 1:02x}:00.0"
        nic = t.pci(nic_port, nic_addr, 0x15B3, 0x1021, 0x020700, node, "mlx5_core",
                    sub_device=0x0041, irq=0)
        add_rdma(t, nic, index, bus + 1)

    t.comment("NVMe on socket 1 (noise)")
    root = t.bridge("/sys/devices/pci0000:e1", "0000:e1:01.0", 0x352A, 1)
    t.pci(root, "0000:e2:00.0", 0x144D, 0xA824, 0x010802, 1, "nvme", sub_device=0xA801,
          speed="16.0 GT/s PCIe", width=4)

    t.comment("NVIDIA driver procfs and control nodes")
    t.f("/proc/driver/nvidia/version",
        f"NVRM version: NVIDIA UNIX x86_64 Kernel Module  {DRIVER_VERSION}  Wed Nov 1 "
        "22:47:33 UTC 2023\nGCC version:  gcc version 11.4.0 (Ubuntu 11.4.0-1ubuntu1~22.04)")
    t.c("/dev/nvidiactl", 195, 255)
    t.c("/dev/nvidia-modeset", 195, 254)
    t.c("/dev/nvidia-uvm", 509, 0)
    t.c("/dev/nvidia-uvm-tools", 509, 1)
    t.c("/dev/nvidia-caps/nvidia-cap1", 508, 1)
    t.c("/dev/nvidia-caps/nvidia-cap2", 508, 2)

    t.comment("RDMA class roots")
    t.f("/sys/class/infiniband_verbs/abi_version", "6")
    t.f("/sys/class/infiniband_mad/abi_version", "5")
    misc = "/sys/devices/virtual/misc/rdma_cm"
    t.f(f"{misc}/dev", "10:58")
    t.l("/sys/class/misc/rdma_cm", misc)
    t.c("/dev/infiniband/rdma_cm", 10, 58)
    return t.lines


def add_rdma(t: Tree, nic: str, index: int, bus: int) -> None:
    """mlx5_N under the NIC function, as ib_register_device / ib_uverbs / ib_umad add them."""
    ibdev = f"mlx5_{index}"
    guid = guid_for(index)
    ib = f"{nic}/infiniband/{ibdev}"
    t.f(f"{ib}/node_type", "1: CA")
    t.f(f"{ib}/node_guid", guid)
    t.f(f"{ib}/sys_image_guid", guid)
    t.f(f"{ib}/fw_ver", "28.39.1002")
    t.f(f"{ib}/hca_type", "MT4129")
    t.f(f"{ib}/hw_rev", "0x0")
    t.f(f"{ib}/board_id", "MT_0000000838")
    t.l(f"{ib}/device", nic)
    port = f"{ib}/ports/1"
    t.f(f"{port}/state", "4: ACTIVE")
    t.f(f"{port}/phys_state", "5: LinkUp")
    t.f(f"{port}/link_layer", "InfiniBand")
    t.f(f"{port}/rate", "400 Gb/sec (4X NDR)")
    t.f(f"{port}/lid", f"0x{0x21 + index:x}")
    t.f(f"{port}/sm_lid", "0x1")
    t.f(f"{port}/lid_mask_count", "0")
    t.f(f"{port}/sm_sl", "0")
    t.f(f"{port}/cap_mask", "0xa751e848")
    t.f(f"{port}/gids/0", "fe80:0000:0000:0000:" + guid)
    t.f(f"{port}/pkeys/0", "0xffff")
    t.l(f"/sys/class/infiniband/{ibdev}", ib)

    verbs = f"{nic}/infiniband_verbs/uverbs{index}"
    t.f(f"{verbs}/ibdev", ibdev)
    t.f(f"{verbs}/abi_version", "1")
    t.f(f"{verbs}/dev", f"231:{192 + index}")
    t.l(f"{verbs}/device", nic)
    t.l(f"/sys/class/infiniband_verbs/uverbs{index}", verbs)
    t.c(f"/dev/infiniband/uverbs{index}", 231, 192 + index)

    mad = f"{nic}/infiniband_mad"
    for kind, minor in (("umad", index), ("issm", 64 + index)):
        folder = f"{mad}/{kind}{index}"
        t.f(f"{folder}/ibdev", ibdev)
        t.f(f"{folder}/port", "1")
        t.f(f"{folder}/dev", f"231:{minor}")
        t.l(f"{folder}/device", nic)
        t.l(f"/sys/class/infiniband_mad/{kind}{index}", folder)
        t.c(f"/dev/infiniband/{kind}{index}", 231, minor)

    netdev = f"ibp{bus}s0"
    net = f"{nic}/net/{netdev}"
    t.f(f"{net}/type", "32")
    t.f(f"{net}/operstate", "up")
    t.f(f"{net}/carrier", "1")
    raw = guid.replace(":", "")
    guid_bytes = ":".join(raw[i : i + 2] for i in range(0, 16, 2))
    t.f(f"{net}/address", f"00:00:10:{0x29 + index:02x}:fe:80:00:00:00:00:00:00:{guid_bytes}")
    t.f(f"{net}/mtu", "4092")
    t.l(f"{net}/device", nic)
    t.l(f"/sys/class/net/{netdev}", net)


if __name__ == "__main__":
    sys.stdout.write("\n".join(generate()) + "\n")
