"""Writes testkit/device_plugin_host_testing/machines/sriov-network-node.tree.

The machine: a two-socket Ice Lake-SP network node (a Dell R750 class box). Socket 0 carries an
Intel E810-C 2x100G (0x8086:0x1592, ice; VFs 0x1889 on iavf) with irdma (iWARP) on both ports;
socket 1 a Mellanox ConnectX-6 Dx 2x100G (0x15b3:0x101d, mlx5_core; VFs 0x101e) in RoCE mode.
Port 0 of each card has 8 VFs: 0-3 on the netdev VF driver, 4-7 on vfio-pci for DPDK. Port 1 of
each card has SR-IOV off. A BCM5720 LOM on the PCH carries the host's own traffic.

Run: python tests/resources/gen_sriov_network_node.py
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from host.sim.fake_net import (  # noqa: E402
    net_interface,
    rdma_cm,
    rdma_device,
    sriov_pf,
    vfio_nodes,
)
from host.sim.tree import FakeTree  # noqa: E402

NODE0_CPUS = "0-31,64-95"
NODE1_CPUS = "32-63,96-127"


def build(tree: FakeTree) -> None:
    for node, cpus in ((0, NODE0_CPUS), (1, NODE1_CPUS)):
        tree.attr(f"/sys/devices/system/node/node{node}/cpulist", cpus)
    tree.attr("/sys/devices/system/node/possible", "0-1")
    tree.attr("/sys/devices/system/node/online", "0-1")

    # PCH: host bridge, a root port and the BCM5720 LOM (eno1 up, eno2 unused).
    tree.pci_function(
        "0000:00:00.0",
        vendor=0x8086,
        device=0x09A2,
        pci_class=0x060000,
        numa_node=0,
        iommu_group=0,
        local_cpulist=NODE0_CPUS,
    )
    pch_port = tree.pci_function(
        "0000:00:1c.0",
        vendor=0x8086,
        device=0xA190,
        pci_class=0x060400,
        numa_node=0,
        driver="pcieport",
        iommu_group=9,
        local_cpulist=NODE0_CPUS,
    )
    for func, ifname, state in ((0, "eno1", "up"), (1, "eno2", "down")):
        lom = tree.pci_function(
            f"0000:04:00.{func}",
            vendor=0x14E4,
            device=0x165F,
            pci_class=0x020000,
            numa_node=0,
            driver="tg3",
            iommu_group=10 + func,
            parent=pch_port,
            local_cpulist=NODE0_CPUS,
            subsystem_vendor=0x1028,
            subsystem_device=0x08FF,
        )
        net_interface(
            tree,
            lom,
            ifname,
            operstate=state,
            carrier=1 if state == "up" else None,
            mac=f"b0:7b:25:d4:1a:{0x30 + func:02x}",
        )

    # Socket 0, PCIe stack pci0000:30: E810-C in slot 1.
    port0 = tree.pci_function(
        "0000:30:02.0",
        vendor=0x8086,
        device=0x347A,
        pci_class=0x060400,
        numa_node=0,
        driver="pcieport",
        iommu_group=20,
        local_cpulist=NODE0_CPUS,
    )
    e810 = sriov_pf(
        tree,
        "0000:31:00.0",
        vendor=0x8086,
        device=0x1592,
        vf_device=0x1889,
        numvfs=8,
        totalvfs=128,
        driver="ice",
        vf_driver="iavf",
        vfio=range(4, 8),
        ifname="ens1f0",
        vf_ifname="ens1f0v{index}",
        numa_node=0,
        local_cpulist=NODE0_CPUS,
        parent=port0,
        iommu_group=21,
        vf_iommu_group=180,
        vf_offset=8,
        vf_stride=1,
        dev_nodes=False,
    )
    for index, group in enumerate(e810.vf_groups[4:8]):
        vfio_nodes(tree, group, index)
    sriov_pf(
        tree,
        "0000:31:00.1",
        vendor=0x8086,
        device=0x1592,
        vf_device=0x1889,
        numvfs=0,
        totalvfs=128,
        driver="ice",
        ifname="ens1f1",
        numa_node=0,
        local_cpulist=NODE0_CPUS,
        parent=port0,
        iommu_group=22,
        vf_offset=135,
        operstate="down",
        carrier=0,
    )
    for func in (0, 1):
        rdma_device(
            tree,
            f"{port0}/0000:31:00.{func}",
            f"irdma{func}",
            link_layers=("Ethernet",),
            uverbs=func,
            umad=None,
            node_guid=f"b696:91ff:fe9c:4a{func}0",
            state="4: ACTIVE" if func == 0 else "1: DOWN",
            phys_state="5: LinkUp" if func == 0 else "3: Disabled",
        )

    # Socket 1, PCIe stack pci0000:97: ConnectX-6 Dx in slot 2, RoCE.
    port1 = tree.pci_function(
        "0000:97:02.0",
        vendor=0x8086,
        device=0x347A,
        pci_class=0x060400,
        numa_node=1,
        driver="pcieport",
        iommu_group=70,
        local_cpulist=NODE1_CPUS,
    )
    cx6 = sriov_pf(
        tree,
        "0000:98:00.0",
        vendor=0x15B3,
        device=0x101D,
        vf_device=0x101E,
        numvfs=8,
        totalvfs=8,
        driver="mlx5_core",
        vf_driver="mlx5_core",
        vfio=range(4, 8),
        ifname="ens2f0np0",
        vf_ifname="ens2f0v{index}",
        numa_node=1,
        local_cpulist=NODE1_CPUS,
        parent=port1,
        iommu_group=71,
        vf_iommu_group=200,
        vf_offset=2,
        vf_stride=1,
        dev_nodes=False,
    )
    for index, group in enumerate(cx6.vf_groups[4:8]):
        vfio_nodes(tree, group, 4 + index)
    cx6_1 = sriov_pf(
        tree,
        "0000:98:00.1",
        vendor=0x15B3,
        device=0x101D,
        vf_device=0x101E,
        numvfs=0,
        totalvfs=8,
        driver="mlx5_core",
        ifname="ens2f1np1",
        numa_node=1,
        local_cpulist=NODE1_CPUS,
        parent=port1,
        iommu_group=72,
        vf_offset=9,
    )
    tree.attr(f"{cx6.path}/net/ens2f0np0/phys_port_name", "p0")
    tree.attr(f"{cx6_1.path}/net/ens2f1np1/phys_port_name", "p1")
    for func, path in enumerate((cx6.path, cx6_1.path)):
        rdma_device(
            tree,
            path,
            f"mlx5_{func}",
            link_layers=("Ethernet",),
            uverbs=2 + func,
            umad=func,
            node_guid=f"1070:fd03:00c1:8a{func}0",
        )
    for index in range(4):
        rdma_device(
            tree,
            cx6.vf_paths[index],
            f"mlx5_{2 + index}",
            link_layers=("Ethernet",),
            uverbs=4 + index,
            umad=2 + index,
            node_guid="0000:0000:0000:0000",
        )
    rdma_cm(tree, minor=58)


def dump(root: str) -> list:
    """The tree as ``.tree`` lines: links, leaf dirs, attributes, and /dev nodes as ``c``."""
    lines = [
        "# sriov-network-node: 2-socket Ice Lake-SP; E810-C (node 0), ConnectX-6 Dx (node 1)",
        "# generated by tests/resources/gen_sriov_network_node.py",
    ]
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        host_dir = dirpath[len(root) :] or "/"
        entries = sorted(dirnames + filenames)
        if not entries and host_dir != "/":
            lines.append(f"d {host_dir}")
        for name in entries:
            real = os.path.join(dirpath, name)
            host = f"{host_dir.rstrip('/')}/{name}"
            if os.path.islink(real):
                lines.append(f"l {host} -> {os.readlink(real)}")
                if name in dirnames:
                    dirnames.remove(name)
            elif os.path.isfile(real):
                text = Path(real).read_text(encoding="utf-8").rstrip("\n")
                if host.startswith("/dev/"):
                    lines.append(f"c {host} {text}")
                else:
                    lines.append(f"f {host} {json.dumps(text)}")
    return lines


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        tree = FakeTree(tmp)
        build(tree)
        lines = dump(tree.root)
    out = ROOT / "testkit" / "device_plugin_host_testing" / "machines" / "sriov-network-node.tree"
    out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"wrote {out} ({len(lines)} lines)")


if __name__ == "__main__":
    main()
