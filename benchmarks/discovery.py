"""Driver discovery over big fake trees, against replaying the same file-system calls bare.

Trees are generated once per run into a temporary directory (untimed): 2048 PCI GPU functions
for the ``gpu`` driver (254 NVIDIA, the rest AMD and Intel, over 8 NUMA nodes and two PCI
domains, every one healthy), and 16 SR-IOV PFs with 64 VFs each (1024 VFs, half on vfio-pci,
half on iavf with netdevs) for the ``sriov`` driver, and a QAT node for it too: 4 4xxx PFs
with 64 VFs each (half on vfio-pci with device cdevs, half on 4xxxvf), served as three pools
by service and VF driver (``discovery_ms_qat_256``); an 8x MI300X node in CPX/NPS4 mode (64
compute partitions from the KFD topology, 64 render nodes, 4096 XGMI io_links) for the ``gpu``
driver's partition path, timed as full scans (a fresh driver each run, as after a restart or
a repartition), with the cheaper rescan that keeps the KFD topology in the notes.

Figure: ``driver.discover(HostFS(root), resources)``, median of several warm runs (the page
and dentry caches hot, as on a node rescanning). Floor: the file-system calls that discovery
made, recorded once through a HostFS that logs them, replayed from a flat list with the bare
primitives (os.open/os.read/os.close for each attribute read, os.readlink for each link,
os.listdir for each directory, os.stat for each existence check or link resolution): the I/O
the driver cannot avoid, with none of its parsing or logic. The notes also give the attribute
reads alone, the narrowest floor. Runs alternate.
"""

from __future__ import annotations

import os
import tempfile
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from benchmarks.core import Context, Figure, median, memory_tmp, now
from device_plugin_host_testing import fake_qat
from drivers.gpu.driver import GpuDriver
from drivers.sriov.driver import SriovDriver
from host.core.driver import Driver
from host.core.hostfs import HostFS
from host.core.model import ResourceConfig
from host.sim import fake_gpu, fake_net
from host.sim.tree import FakeTree

KEYS = ("discovery_ms_2048", "discovery_ms_sriov_1024", "discovery_ms_qat_256",
        "discovery_ms_cpx_64")
NUMA_NODES = 8
NVIDIA_GPUS = 254  # every minor the NVIDIA driver can hand a GPU (0..253)
SRIOV_PFS = 16
VFS_PER_PF = 64

Op = Tuple[str, str]
_FLAGS = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)


class RecordingHostFS(HostFS):
    """A HostFS that logs every file-system call it is asked for, as (kind, real path)."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.ops: List[Op] = []

    def read(self, host_path: str) -> Optional[str]:
        self.ops.append(("read", self.real(host_path)))
        return super().read(host_path)

    def readlink(self, host_path: str) -> Optional[str]:
        self.ops.append(("readlink", self.real(host_path)))
        return super().readlink(host_path)

    def listdir(self, host_path: str) -> List[str]:
        self.ops.append(("listdir", self.real(host_path)))
        return super().listdir(host_path)

    def exists(self, host_path: str) -> bool:
        self.ops.append(("stat", self.real(host_path)))
        return super().exists(host_path)

    def is_dir(self, host_path: str) -> bool:
        self.ops.append(("stat", self.real(host_path)))
        return super().is_dir(host_path)

    def resolve(self, host_path: str) -> Optional[str]:
        self.ops.append(("stat", self.real(host_path)))
        return super().resolve(host_path)


def replay(ops: Sequence[Op]) -> None:
    """The recorded calls, bare. Missing files fail the same way they failed for the driver."""
    for kind, path in ops:
        try:
            if kind == "read":
                fd = os.open(path, _FLAGS)
                try:
                    os.read(fd, 65536)
                finally:
                    os.close(fd)
            elif kind == "readlink":
                os.readlink(path)
            elif kind == "listdir":
                os.listdir(path)
            else:
                os.stat(path)
        except OSError:
            pass


# -- trees -----------------------------------------------------------------------------------
def build_gpu_tree(root: str, count: int = 2048) -> None:
    """``count`` GPU functions, eight per bus, 1024 buses' worth per PCI domain."""
    tree = FakeTree(root)
    tree.numa_nodes(NUMA_NODES)
    fake_gpu.add_nvidia_control_nodes(tree)
    nvidia = min(NVIDIA_GPUS, count // 3 or 1)
    for i in range(count):
        address = f"{i // 1024:04x}:{1 + (i % 1024) // 8:02x}:{i % 8:02x}.0"
        numa = (i * NUMA_NODES) // count
        if i < nvidia:
            fake_gpu.add_nvidia_gpu(tree, address, minor=i, numa_node=numa, iommu_group=i)
        elif i % 2:
            fake_gpu.add_amd_gpu(tree, address, card=i, render=128 + i, numa_node=numa,
                                 iommu_group=i)
        else:
            fake_gpu.add_intel_gpu(tree, address, card=i, render=128 + i, numa_node=numa,
                                   iommu_group=i)


def build_sriov_tree(root: str, pfs: int = SRIOV_PFS, vfs: int = VFS_PER_PF) -> None:
    """``pfs`` E810 PFs on their own buses, each with ``vfs`` VFs: even PFs' VFs on vfio-pci,
    odd PFs' on iavf with netdevs."""
    tree = FakeTree(root)
    tree.numa_nodes(2)
    for k in range(pfs):
        fake_net.sriov_pf(
            tree, f"0000:{0x10 + k:02x}:00.0", numvfs=vfs, ifname=f"ens{k}f0",
            vfio=range(vfs) if k % 2 == 0 else (), numa_node=k % 2,
            iommu_group=k, vf_iommu_group=1000 + k * vfs,
        )


def build_qat_tree(root: str, pfs: int = 4, vfs: int = 64) -> None:
    """A QAT node: ``pfs`` 4xxx endpoints (alternately sym;asym and dc, two per NUMA node),
    each with ``vfs`` VFs, the first half on vfio-pci (with vfio device cdevs), the rest on
    4xxxvf, debugfs heartbeats readable."""
    tree = FakeTree(root)
    tree.numa_nodes(2)
    for k in range(pfs):
        fake_qat.qat_pf(
            tree, f"0000:{0x6b + 5 * k:02x}:00.0", numvfs=vfs, totalvfs=vfs,
            services="sym;asym" if k % 2 == 0 else "dc", vfio=range(vfs // 2),
            numa_node=k * 2 // pfs, iommu_group=k, vf_iommu_group=1000 + k * vfs,
            cdev_base=k * (vfs // 2),
        )
def build_cpx_tree(root: str, gpus: int = 8) -> None:
    """``gpus`` MI300X in CPX/NPS4, one XGMI hive, four per NUMA node (fake_gpu.AmdMachine)."""
    tree = FakeTree(root)
    tree.numa_nodes(2)
    machine = fake_gpu.AmdMachine(tree, cpu_nodes=2)
    for number in range(gpus):
        machine.add_gpu(f"0000:{0x05 + number * 0x20:02x}:00.0", numa_node=number * 2 // gpus,
                        compute="CPX", memory="NPS4")
    machine.write_kfd()


# -- measurement -----------------------------------------------------------------------------
def _measure_driver(ctx: Context, key: str, driver: Driver, resources: List[ResourceConfig],
                    root: str, expected: int,
                    fresh: Optional[Callable[[], Driver]] = None) -> Figure:
    """``fresh`` makes every timed run use a new driver, so nothing a driver caches between
    scans (the gpu driver's KFD topology) is reused: a full scan, as after a restart."""
    runs = ctx.pick(15, 5, 1)
    driver.discover(HostFS(root), resources)  # warms the page cache and any driver cache
    recorder = RecordingHostFS(root)
    # The calls the timed runs make: a rescan's for a kept driver, a first scan's for fresh.
    found = (fresh() if fresh else driver).discover(recorder, resources)
    total = sum(len(devices) for devices in found.values())
    healthy = sum(1 for devices in found.values() for d in devices if d.healthy)
    if total != expected:
        raise RuntimeError(f"{key}: the driver found {total} devices, the tree has {expected}")
    ops = list(recorder.ops)
    reads = [op for op in ops if op[0] == "read"]
    host = HostFS(root)
    timings: Dict[str, List[float]] = {"driver": [], "floor": [], "reads": []}
    runners: Dict[str, Callable[[], object]] = {
        "driver": ((lambda: fresh().discover(host, resources)) if fresh
                   else (lambda: driver.discover(host, resources))),
        "floor": lambda: replay(ops),
        "reads": lambda: replay(reads),
    }
    for _ in range(runs):
        for name, runner in runners.items():
            started = now()
            runner()
            timings[name].append((now() - started) * 1000)
    counts: Dict[str, int] = {}
    for kind, _ in ops:
        counts[kind] = counts.get(kind, 0) + 1
    calls = ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
    return Figure(key, median(timings["driver"]), "ms", median(timings["floor"]), [
        f"{total} devices ({healthy} healthy), median of {runs}; floor replays {calls}",
        f"the attribute reads alone (os.open/os.read): {median(timings['reads']):.1f} ms",
    ])


def _warm_note(ctx: Context, resources: List[ResourceConfig], root: str) -> str:
    """A rescan by a driver that keeps its KFD topology (generation_id unchanged: every pci or
    drm event that is not a repartition), against its own, much smaller, set of calls."""
    driver = GpuDriver()
    driver.discover(HostFS(root), resources)
    recorder = RecordingHostFS(root)
    driver.discover(recorder, resources)
    ops = list(recorder.ops)
    host = HostFS(root)
    warm: List[float] = []
    floor: List[float] = []
    for _ in range(ctx.pick(15, 5, 1)):
        started = now()
        driver.discover(host, resources)
        warm.append((now() - started) * 1000)
        started = now()
        replay(ops)
        floor.append((now() - started) * 1000)
    value, bare = median(warm), median(floor)
    return (f"rescan with the KFD topology kept (generation_id unchanged, {len(ops)} calls):"
            f" {value:.2f} ms vs {bare:.2f} ms bare, {value / bare:.2f}x")


def run(ctx: Context) -> List[Figure]:
    figures = []
    with tempfile.TemporaryDirectory(prefix="dphb-disc-", dir=memory_tmp()) as work:
        if ctx.wants("discovery_ms_2048"):
            count = 2048 if not ctx.tiny else 24
            root = os.path.join(work, "gpu")
            ctx.progress(f"generating a tree of {count} GPUs")
            build_gpu_tree(root, count)
            figure = _measure_driver(ctx, "discovery_ms_2048", GpuDriver(), [
                ResourceConfig("nvidia.com/gpu", "gpu", {"vendor": "0x10de"}),
                ResourceConfig("amd.com/gpu", "gpu", {"vendor": "0x1002"}),
                ResourceConfig("gpu.intel.com/i915", "gpu",
                               {"vendor": "0x8086", "kernel_driver": "i915"}),
            ], root, count)
            if ctx.tiny:
                figure.notes.append(f"tiny run: {count} GPUs")
            figures.append(figure)
        if ctx.wants("discovery_ms_sriov_1024"):
            pfs, vfs = (SRIOV_PFS, VFS_PER_PF) if not ctx.tiny else (2, 4)
            root = os.path.join(work, "sriov")
            ctx.progress(f"generating a tree of {pfs * vfs} SR-IOV VFs")
            build_sriov_tree(root, pfs, vfs)
            figure = _measure_driver(ctx, "discovery_ms_sriov_1024", SriovDriver(), [
                ResourceConfig("example.com/sriov_vf", "sriov", {"vendor": "0x8086"}),
            ], root, pfs * vfs)
            if ctx.tiny:
                figure.notes.append(f"tiny run: {pfs * vfs} VFs")
            figures.append(figure)
        if ctx.wants("discovery_ms_qat_256"):
            pfs, vfs = (4, 64) if not ctx.tiny else (2, 4)
            root = os.path.join(work, "qat")
            ctx.progress(f"generating a QAT node with {pfs * vfs} VFs")
            build_qat_tree(root, pfs, vfs)
            vfio = {"device": "0x4941", "kernel_driver": "vfio-pci"}
            figure = _measure_driver(ctx, "discovery_ms_qat_256", SriovDriver(), [
                ResourceConfig("qat.intel.com/cy", "sriov", {**vfio, "qat_services": "sym;asym"}),
                ResourceConfig("qat.intel.com/dc", "sriov", {**vfio, "qat_services": "dc"}),
                ResourceConfig("qat.intel.com/cy_kernel", "sriov",
                               {"device": "0x4941", "kernel_driver": "4xxxvf"}),
            ], root, pfs * vfs)
            if ctx.tiny:
                figure.notes.append(f"tiny run: {pfs * vfs} VFs")
            figures.append(figure)
        if ctx.wants("discovery_ms_cpx_64"):
            gpus = 8 if not ctx.tiny else 1
            root = os.path.join(work, "cpx")
            ctx.progress(f"generating {gpus} MI300X in CPX mode ({gpus * 8} partitions)")
            build_cpx_tree(root, gpus)
            cpx = [ResourceConfig("amd.com/cpx_nps4", "gpu",
                                  {"vendor": "0x1002", "partition_mode": "cpx_nps4"})]
            # The headline is a full scan (a new driver each run): what a repartition costs,
            # since it moves KFD's generation_id; the kept-topology rescan is in the notes.
            figure = _measure_driver(ctx, "discovery_ms_cpx_64", GpuDriver(), cpx, root,
                                     gpus * 8, fresh=GpuDriver)
            figure.notes.append(_warm_note(ctx, cpx, root))
            if ctx.tiny:
                figure.notes.append(f"tiny run: {gpus * 8} partitions")
            figures.append(figure)
    return figures
