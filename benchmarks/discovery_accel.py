"""Discovery by the accel, neuron and pci drivers over big fake trees, against replaying the
same file-system calls bare (the method of benchmarks/discovery.py, reused).

    python -m benchmarks.discovery_accel [--quick]

Not part of the contract suite (its keys are fixed by tests/test_benchmarks.py); it prints the
same kind of figure: the driver's median, the floor measured in the same run, the ratio.

Trees: 512 Gaudi cards over 8 NUMA nodes (512 accel minors + 512 control nodes); 64 Neuron
devices; 256 Hailo-8 boards plus 2,048 unrelated char devices (ttys, one per board's
neighbour function) in /sys/dev/char, so the pci driver's char index has real work to skip.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from typing import List

from benchmarks.core import Context, Figure, memory_tmp
from benchmarks.discovery import _measure_driver
from device_plugin_host_testing import fake_accel, fake_neuron, fake_pci
from device_plugin_host_testing.fake_chardev import add_class_chardev
from drivers.accel.driver import AccelDriver
from drivers.neuron.driver import NeuronDriver
from drivers.pci.driver import PciDriver
from host.core.model import ResourceConfig
from host.sim.tree import FakeTree

KEYS = ("discovery_ms_accel_512", "discovery_ms_neuron_64", "discovery_ms_pci_256")


def build_accel_tree(root: str, cards: int) -> None:
    tree = FakeTree(root)
    tree.numa_nodes(8)
    for index in range(cards):
        address = f"{index // 256:04x}:{1 + index % 256 // 2:02x}:{index % 2:02x}.0"
        fake_accel.add_gaudi(tree, address, index, numa_node=index * 8 // cards)


def build_neuron_tree(root: str, devices: int) -> None:
    tree = FakeTree(root)
    tree.numa_nodes(2)
    for index in range(devices):
        fake_neuron.add_neuron_function(tree, f"0000:{0x10 + index:02x}:1e.0",
                                        numa_node=index * 2 // devices)
        fake_neuron.add_neuron_device(tree, index)


def build_pci_tree(root: str, boards: int, noise_per_board: int = 8) -> None:
    tree = FakeTree(root)
    tree.numa_nodes(2)
    for index in range(boards):
        bus = 1 + index % 250
        domain = index // 250
        fake_pci.add_hailo8(tree, f"{domain:04x}:{bus:02x}:00.0", index,
                            numa_node=index * 2 // boards)
        uart = tree.pci_function(f"{domain:04x}:{bus:02x}:00.1", vendor=0x1415, device=0xC158,
                                 pci_class=0x070002, driver="serial", numa_node=0)
        for k in range(noise_per_board):
            number = index * noise_per_board + k
            add_class_chardev(tree, uart, "tty", f"ttyS{number}", 4, 64 + number)


def run(ctx: Context) -> List[Figure]:
    figures = []
    with tempfile.TemporaryDirectory(prefix="dphb-accel-", dir=memory_tmp()) as work:
        cards = 512 if not ctx.tiny else 8
        root = os.path.join(work, "accel")
        build_accel_tree(root, cards)
        figures.append(_measure_driver(ctx, KEYS[0], AccelDriver(), [
            ResourceConfig("habana.ai/gaudi", "accel", {"kernel_driver": "habanalabs"}),
        ], root, cards))
        devices = 64 if not ctx.tiny else 4
        root = os.path.join(work, "neuron")
        build_neuron_tree(root, devices)
        figures.append(_measure_driver(ctx, KEYS[1], NeuronDriver(), [
            ResourceConfig("aws.amazon.com/neuron", "neuron", {}),
        ], root, devices))
        boards = 256 if not ctx.tiny else 4
        root = os.path.join(work, "pci")
        build_pci_tree(root, boards)
        figures.append(_measure_driver(ctx, KEYS[2], PciDriver(), [
            ResourceConfig("hailo.ai/npu", "pci", {"vendor": "0x1e60", "device": "0x2864"}),
        ], root, boards))
    return figures


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.discovery_accel")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    for figure in run(Context(quick=args.quick)):
        ratio = figure.value / figure.floor if figure.floor else float("nan")
        print(f"{figure.key}: {figure.value:.1f} ms, floor {figure.floor:.1f} ms, "
              f"ratio {ratio:.2f}x; {'; '.join(figure.notes)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
