"""Regenerate testkit/device_plugin_host_testing/machines/edge-box.tree and fpga-node.tree.

    python tests/resources/gen_usb_fpga_trees.py

Both machines are built with the fixture helpers (host/sim/fake_usb.py, fake_fpga.py),
whose shapes follow the kernel's (see their docstrings), then written out in the ``.tree``
format. Only the .tree files are used by tests; this script documents where they came from.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Iterator, List

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from device_plugin_host_testing import fake_fpga as ff
from host.sim import fake_usb as fu
from host.sim.tree import FakeTree

MACHINES = Path(__file__).resolve().parents[2] / "testkit" / "device_plugin_host_testing" \
    / "machines"


def dump(root: str, header: List[str]) -> Iterator[str]:
    """The tree under ``root`` as .tree lines, sorted, /dev files as ``c`` entries."""
    yield from (f"# {line}" if line else "#" for line in header)
    entries = []
    for dirpath, dirnames, filenames in os.walk(root):
        host_dir = dirpath[len(root) :] or "/"
        for name in sorted(dirnames + filenames):
            real = os.path.join(dirpath, name)
            host = f"{host_dir.rstrip('/')}/{name}"
            if os.path.islink(real):
                entries.append(f"l {host} -> {os.readlink(real)}")
            elif os.path.isdir(real):
                if not os.listdir(real):
                    entries.append(f"d {host}")
            elif host.startswith("/dev/"):
                with open(real, encoding="utf-8") as handle:
                    entries.append(f"c {host} {handle.read().strip()}")
            else:
                with open(real, encoding="utf-8") as handle:
                    entries.append(f"f {host} {json.dumps(handle.read().rstrip(chr(10)))}")
        dirnames[:] = [d for d in dirnames if not os.path.islink(os.path.join(dirpath, d))]
    yield from sorted(entries)


def edge_box(tree: FakeTree) -> None:
    tree.numa_nodes(1, cpus_per_node=8)
    # Tiger Lake-LP xHCI (USB 2 bus 1, USB 3 bus 2) and the Thunderbolt 4 xHCI (buses 3, 4).
    fu.usb_controller(tree, "0000:00:14.0", device=0xA0ED, iommu_group=5, local_cpulist="0-7")
    fu.usb_controller(
        tree,
        "0000:00:0d.0",
        device=0x9A13,
        buses=((3, "480"), (4, "10000")),
        iommu_group=3,
        local_cpulist="0-7",
    )
    # A 4-port USB 3 hub: its USB 2 half on bus 1, its SuperSpeed half on bus 2.
    fu.hub(tree, "1-1", devnum=2)
    fu.hub(tree, "2-1", devnum=2, product=0x0626, speed="5000", product_name="USB3.1 Hub")
    fu.usb_device(
        tree,
        "1-1.1",
        vendor=0x0403,
        product=0x6001,
        devnum=5,
        serial="A50285BI",
        manufacturer="FTDI",
        product_name="FT232R USB UART",
        speed="12",
        interfaces=[fu.Interface(0xFF, 0xFF, 0xFF, driver="ftdi_sio", tty=["ttyUSB1"])],
    )
    fu.usb_device(
        tree,
        "1-1.2",
        vendor=0x10C4,
        product=0xEA60,
        devnum=6,
        serial="c8f3a4b1e2d5ec11b0a2d4c7a9e1f3b2",
        manufacturer="ITead",
        product_name="Sonoff Zigbee 3.0 USB Dongle Plus",
        speed="12",
        interfaces=[fu.Interface(0xFF, driver="cp210x", tty=["ttyUSB0"])],
    )
    fu.usb_device(
        tree,
        "1-1.3",
        vendor=0x046D,
        product=0x082D,
        devnum=7,
        serial="A8F4E2BF",
        device_class=0xEF,
        product_name="HD Pro Webcam C920",
        interfaces=[
            fu.Interface(0x0E, 0x01, driver="uvcvideo", video=["video0", "video1"]),
            fu.Interface(0x0E, 0x02, driver="uvcvideo"),
            fu.Interface(0x01, 0x01, driver="snd-usb-audio"),
            fu.Interface(0x01, 0x02, driver="snd-usb-audio"),
        ],
    )
    # A SafeNet/Aladdin HASP HL licence key: vendor class, no kernel driver (aksusbd uses
    # libusb), no serial string.
    fu.usb_device(
        tree,
        "1-1.4",
        vendor=0x0529,
        product=0x0001,
        devnum=9,
        manufacturer="AKS",
        product_name="HASP HL 3.25",
        speed="12",
        interfaces=[fu.Interface(0xFF)],
    )
    fu.usb_device(
        tree,
        "1-4",
        vendor=0x1050,
        product=0x0407,
        devnum=3,
        manufacturer="Yubico",
        product_name="YubiKey OTP+FIDO+CCID",
        speed="12",
        interfaces=[
            fu.Interface(
                0x03, 0x01, 0x01, driver="usbhid", hidraw=["hidraw0"], hid_id="0003:1050:0407.0001"
            ),
            fu.Interface(0x03, driver="usbhid", hidraw=["hidraw1"], hid_id="0003:1050:0407.0002"),
            fu.Interface(0x0B),
        ],
    )
    fu.usb_device(
        tree,
        "1-6",
        vendor=0x1A86,
        product=0x7523,
        devnum=4,
        product_name="USB Serial",
        speed="12",
        interfaces=[fu.Interface(0xFF, 0x01, 0x02, driver="ch341", tty=["ttyUSB2"])],
    )
    fu.usb_device(
        tree,
        "1-10",
        vendor=0x8087,
        product=0x0026,
        devnum=8,
        device_class=0xE0,
        speed="12",
        interfaces=[
            fu.Interface(0xE0, 0x01, 0x01, driver="btusb"),
            fu.Interface(0xE0, 0x01, 0x01, driver="btusb"),
        ],
    )
    # Coral USB Accelerator after its runtime loaded the firmware (18d1:9302, SuperSpeed).
    fu.usb_device(
        tree,
        "2-1.4",
        vendor=0x18D1,
        product=0x9302,
        devnum=3,
        speed="5000",
        interfaces=[fu.Interface(0xFF)],
    )


def fpga_node(tree: FakeTree) -> None:
    tree.numa_nodes(2, cpus_per_node=24)
    # BMC VGA (ASPEED) behind its bridge: drm/card0, no render node.
    bridge = tree.pci_bridge("0000:00:1c.5", numa_node=0)
    tree.pci_function(
        "0000:02:00.0",
        vendor=0x1A03,
        device=0x1150,
        pci_class=0x060400,
        numa_node=0,
        driver="pcieport",
        parent=bridge,
    )
    vga = tree.pci_function(
        "0000:03:00.0",
        vendor=0x1A03,
        device=0x2000,
        pci_class=0x030000,
        numa_node=0,
        driver="ast",
        iommu_group=18,
        parent=bridge + "/0000:02:00.0",
        local_cpulist="0-23",
    )
    tree.attr(f"{vga}/drm/card0/dev", "226:0")
    tree.attr(f"{vga}/drm/card0/uevent", "MAJOR=226\nMINOR=0\nDEVNAME=dri/card0")
    tree.link("/sys/class/drm/card0", f"{vga}/drm/card0")
    tree.chardev("/dev/dri/card0", 226, 0)
    # Intel PAC with Arria 10 GX (socket 0), NLB0 loaded.
    root0 = tree.pci_bridge("0000:3a:00.0", numa_node=0)
    ff.dfl_card(
        tree,
        "0000:3b:00.0",
        device=0x09C4,
        numa_node=0,
        parent=root0,
        iommu_group=30,
        local_cpulist="0-23",
        region=0,
        fme=0,
        interface_id=ff.DCP12_INTERFACE,
        ports=[ff.DflPortSpec(0, afu_id=ff.NLB0_AFU, port_id=0)],
    )
    # Alveo U250 (socket 0): mgmt 5e:00.0 (xclmgmt), user 5e:00.1 (xocl).
    root1 = tree.pci_bridge("0000:5d:00.0", numa_node=0)
    ff.xrt_card(
        tree,
        "0000:5e:00",
        numa_node=0,
        parent=root1,
        local_cpulist="0-23",
        render_minor=128,
        card_minor=1,
        iommu_groups=(40, 41),
        shell="xilinx_u250_gen3x16_xdma_shell_4_1",
        serial="XFL1RT5PHT31",
    )
    # Intel FPGA PAC N3000 (socket 1) behind its on-board PLX PEX 8747 switch.
    root2 = tree.pci_bridge("0000:ae:00.0", numa_node=1)
    up = tree.pci_function(
        "0000:af:00.0",
        vendor=0x10B5,
        device=0x8747,
        pci_class=0x060400,
        numa_node=1,
        driver="pcieport",
        parent=root2,
    )
    down = tree.pci_function(
        "0000:b0:09.0",
        vendor=0x10B5,
        device=0x8747,
        pci_class=0x060400,
        numa_node=1,
        driver="pcieport",
        parent=up,
    )
    ff.dfl_card(
        tree,
        "0000:b1:00.0",
        device=0x0B30,
        numa_node=1,
        parent=down,
        iommu_group=70,
        local_cpulist="24-47",
        region=2,
        fme=1,
        interface_id="bfac4d851ee856fe8c95865ce1bbaa2d",
        ports=[ff.DflPortSpec(1, afu_id="9aeffe5f84570612c000c9660d824272", port_id=0)],
        fme_features=[(0, 0xD)],
        bitstream_id="0x23000410010309",
        sriov_totalvfs=1,
    )
    # Alveo U280 (socket 1), an older XDMA shell.
    root3 = tree.pci_bridge("0000:d7:00.0", numa_node=1)
    ff.xrt_card(
        tree,
        "0000:d8:00",
        mgmt_device=0x500C,
        user_device=0x500D,
        numa_node=1,
        parent=root3,
        local_cpulist="24-47",
        render_minor=129,
        card_minor=2,
        iommu_groups=(90, 91),
        mgmt_minor=1,
        shell="xilinx_u280_xdma_201920_3",
        timestamp="0x000000005e1d6f8c",
        serial="21770297400F",
    )


def main() -> None:
    machines = (
        (
            "edge-box",
            edge_box,
            [
                "edge-box: an Intel NUC-class edge box (Tiger Lake, one socket, numa_node -1)",
                "xHCI 0000:00:14.0 (buses 1/2) with a Genesys USB 3 hub (1-1 / 2-1): FTDI FT232R",
                "1-1.1 (ttyUSB1), Sonoff CP2102N Zigbee 1-1.2 (ttyUSB0), Logitech C920 1-1.3",
                "(video0/1), HASP HL licence key 1-1.4 (no serial); YubiKey 1-4 (hidraw0/1, no",
                "serial), CH340 1-6 (ttyUSB2, no serial),",
                "Intel AX201 Bluetooth 1-10, Coral USB Accelerator 2-1.4 (18d1:9302).",
                "Thunderbolt xHCI 0000:00:0d.0 (buses 3/4) with nothing plugged in.",
                "Generated by tests/resources/gen_usb_fpga_trees.py.",
            ],
        ),
        (
            "fpga-node",
            fpga_node,
            [
                "fpga-node: a two-socket Xeon server with FPGA cards",
                "socket 0: Intel PAC Arria 10 GX 0000:3b:00.0 (dfl-pci; region0, dfl-fme.0,",
                "dfl-port.0 with NLB0), Alveo U250 0000:5e:00.0 mgmt / .1 user (renderD128,",
                "/dev/xclmgmt24064); socket 1: Intel PAC N3000 0000:b1:00.0 behind a PLX switch",
                "(region2, dfl-fme.1, dfl-port.1, Nios feature dfl_dev.0), Alveo U280",
                "0000:d8:00.0 / .1 (renderD129, /dev/xclmgmt55296). BMC VGA 0000:03:00.0 (ast).",
                "Generated by tests/resources/gen_usb_fpga_trees.py.",
            ],
        ),
    )
    for name, build, header in machines:
        with tempfile.TemporaryDirectory() as root:
            tree = FakeTree(root)
            build(tree)
            text = "\n".join(dump(os.path.realpath(root), header)) + "\n"
        (MACHINES / f"{name}.tree").write_text(text, encoding="utf-8")
        print(f"wrote {MACHINES / name}.tree ({text.count(chr(10))} lines)")


if __name__ == "__main__":
    main()
