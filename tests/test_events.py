"""Event-driven discovery: a changed tree plus an event reaches the kubelet in milliseconds."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import uuid

import pytest

from device_plugin_host_testing.drivers import MemoryDriver, make_devices
from device_plugin_host_testing.harness import kubelet_and_host, make_config, running_host
from host.config.plugins import load_drivers
from host.core.model import ResourceConfig
from host.sim import fake_gpu
from host.sim.kubelet import KubeletSimulator
from host.sim.tree import FakeTree
from host.triggers.uevents import InjectedSource


def _gpu_tree(root):
    tree = FakeTree(root)
    tree.numa_nodes(2)
    fake_gpu.add_nvidia_control_nodes(tree)
    fake_gpu.add_nvidia_gpu(tree, "0000:18:00.0", minor=0, numa_node=0)
    return tree


@pytest.mark.alone
def test_hot_plugged_gpu_reaches_the_kubelet_after_one_event(tmp_path, short_dir, run):
    tree = _gpu_tree(tmp_path / "root")
    drivers = load_drivers().drivers
    config = make_config(short_dir, [ResourceConfig("nvidia.com/gpu", "gpu",
                                                    {"vendor": "0x10de"})],
                         host_root=str(tmp_path / "root"), rescan_interval_s=0)
    source = InjectedSource()

    async def scenario():
        async with kubelet_and_host(config, drivers, events=source) as (sim, _app):
            await sim.wait_for(lambda s: "nvidia.com/gpu" in s.resources
                               and s.resources["nvidia.com/gpu"].capacity == 1)
            fake_gpu.add_nvidia_gpu(tree, "0000:86:00.0", minor=1, numa_node=1)
            loop = asyncio.get_running_loop()
            started = loop.time()
            source.inject("pci")
            await sim.wait_for(lambda s: s.resources["nvidia.com/gpu"].allocatable == 2,
                               timeout=2, what="the new GPU")
            assert loop.time() - started < 1.0
            # Unplug: the device stays, Unhealthy, for the grace period.
            tree.remove("/sys/bus/pci/devices/0000:86:00.0")
            source.inject("pci")
            await sim.wait_for(lambda s: s.resources["nvidia.com/gpu"].allocatable == 1,
                               timeout=2, what="the GPU unplugged")
            assert sim.resources["nvidia.com/gpu"].capacity == 2

    run(scenario())


def test_events_rescan_only_the_drivers_that_watch_the_subsystem(short_dir, run):
    usb = MemoryDriver("usbish", {"example.com/u": make_devices("u", 1)})
    usb.subsystems = ("usb",)
    pci = MemoryDriver("pciish", {"example.com/p": make_devices("p", 1)})
    pci.subsystems = ("pci",)
    config = make_config(short_dir, [ResourceConfig("example.com/u", "usbish"),
                                     ResourceConfig("example.com/p", "pciish")],
                         rescan_interval_s=0)
    source = InjectedSource()

    async def scenario():
        drivers = {"usbish": usb, "pciish": pci}
        async with kubelet_and_host(config, drivers, events=source) as (sim, _app):
            await sim.wait_for(lambda s: len(s.resources) == 2
                               and all(r.snapshots for r in s.resources.values()))
            usb_scans, pci_scans = usb.scans, pci.scans
            snapshots_p = sim.resources["example.com/p"].snapshots
            usb.devices["example.com/u"] = make_devices("u", 3)
            for _ in range(50):  # a burst: one coalesced rescan
                source.inject("usb")
            source.inject("block")  # nobody watches it
            await sim.wait_for(lambda s: s.resources["example.com/u"].capacity == 3,
                               timeout=2)
            await asyncio.sleep(0.05)
            assert usb.scans - usb_scans <= 2
            assert pci.scans == pci_scans
            # Only the resource whose snapshot changed sent a new message.
            assert sim.resources["example.com/p"].snapshots == snapshots_p

    run(scenario())


def _can_make_veth() -> bool:
    if shutil.which("ip") is None:
        return False
    name = f"dphprobe{uuid.uuid4().hex[:4]}"
    made = subprocess.run(["ip", "link", "add", name, "type", "veth", "peer", "name",
                           name + "p"], capture_output=True)
    if made.returncode != 0:
        return False
    subprocess.run(["ip", "link", "del", name], capture_output=True)
    return True


def test_real_kernel_uevents_trigger_a_rescan(short_dir, run):
    if not _can_make_veth():
        pytest.skip("creating veth links is not permitted here (needs CAP_NET_ADMIN)")
    driver = MemoryDriver("netish", {"example.com/n": make_devices("n", 1)})
    driver.subsystems = ("net",)
    config = make_config(short_dir, [ResourceConfig("example.com/n", "netish")],
                         rescan_interval_s=0)
    name = f"dph{uuid.uuid4().hex[:6]}"

    async def scenario():
        sim = KubeletSimulator(short_dir)
        await sim.start()
        try:
            async with running_host(config, {"netish": driver}, events="udev") as app:
                await sim.wait_for(lambda s: "example.com/n" in s.resources
                                   and s.resources["example.com/n"].snapshots)
                # The monitor is armed once everything registered, then one catch-up scan
                # runs (host/triggers/events.py DeviceEvents.arm); the change below comes after
                # both, so only the uevent can bring it.
                await asyncio.wait_for(app.ready.wait(), 5)
                await driver.scanned(2)
                assert app.events.source is not None, "the udev monitor did not start"
                await app.rescan()  # scans run one at a time: the catch-up one has ended too
                scans = driver.scans
                driver.devices["example.com/n"] = make_devices("n", 2)
                proc = await asyncio.create_subprocess_exec(
                    "ip", "link", "add", name, "type", "veth", "peer", "name", name + "p")
                await proc.wait()
                await sim.wait_for(lambda s: s.resources["example.com/n"].capacity == 2,
                                   timeout=3, what="rescan after a real uevent")
                assert driver.scans > scans
        finally:
            subprocess.run(["ip", "link", "del", name], capture_output=True)
            await sim.stop()

    run(scenario())
