"""Health state changes are logged once (issues 10.5, 11.16): a PF whose link is down is one
warning however many VFs, resources and scans see it, and one line when it is back."""

from __future__ import annotations

import logging

from drivers.sriov.driver import SriovDriver
from host.core.hostfs import HostFS
from host.core.model import ResourceConfig
from host.sim.fake_net import sriov_pf
from host.sim.tree import FakeTree


def _pf(tree: FakeTree, operstate: str):
    return sriov_pf(tree, "0000:3b:00.0", numvfs=8, ifname="ens1f0", iommu_group=30,
                    vf_iommu_group=100, numa_node=0, operstate=operstate, carrier=None)


def _records(caplog, text):
    return [r for r in caplog.records if text in r.getMessage()]


def test_pf_down_is_one_warning_per_pf_not_per_vf_scan_or_resource(tmp_path, caplog):
    tree = FakeTree(tmp_path)
    tree.numa_nodes(1)
    pf = _pf(tree, "down")
    driver = SriovDriver()
    resources = [ResourceConfig(name="example.com/vf-a", driver="sriov",
                                selectors={"vf_index": "0-3"}),
                 ResourceConfig(name="example.com/vf-b", driver="sriov",
                                selectors={"vf_index": "4-7"})]
    host = HostFS(tree.root)
    caplog.set_level(logging.INFO, logger="drivers.sriov.driver")
    for _ in range(5):  # five health scans
        found = driver.discover(host, resources)
        assert all(not d.healthy for devices in found.values() for d in devices)
    down = _records(caplog, "link of PF ens1f0 is down")
    assert len(down) == 1, [r.getMessage() for r in caplog.records]
    assert down[0].levelno == logging.WARNING and "8 VF(s)" in down[0].getMessage()
    assert not _records(caplog, "reported Unhealthy;")  # no per-VF repeat of the PF's problem

    tree.attr(f"{pf.path}/net/ens1f0/operstate", "up")
    for _ in range(3):
        assert all(d.healthy for devices in driver.discover(host, resources).values()
                   for d in devices)
    assert len(_records(caplog, "is up again")) == 1
    tree.attr(f"{pf.path}/net/ens1f0/operstate", "down")
    driver.discover(host, resources)
    driver.discover(host, resources)
    assert len(_records(caplog, "link of PF ens1f0 is down")) == 2  # a new change, a new line


def test_a_vf_problem_is_logged_once_per_resource_while_it_lasts(tmp_path, caplog):
    tree = FakeTree(tmp_path)
    tree.numa_nodes(1)
    sriov_pf(tree, "0000:3b:00.0", numvfs=2, ifname="ens1f0", iommu_group=30,
             vf_iommu_group=100, numa_node=0, unbound=(1,))
    driver = SriovDriver()
    resource = ResourceConfig(name="example.com/vf", driver="sriov", selectors={})
    caplog.set_level(logging.INFO, logger="drivers.sriov.driver")
    for _ in range(4):
        driver.discover(HostFS(tree.root), [resource])
    assert len(_records(caplog, "is not bound to any driver")) == 1


def test_one_health_timer_per_driver_not_per_resource(short_dir, run):
    """Four resources of one driver at health_interval_s = 0.1: one rescan of the driver per
    0.1 s, not four (each rescan covers every resource of the driver anyway)."""
    import asyncio

    from device_plugin_host_testing.drivers import MemoryDriver, make_devices
    from device_plugin_host_testing.harness import kubelet_and_host, make_config

    names = [f"example.com/h{i}" for i in range(4)]
    driver = MemoryDriver("m", {n: make_devices(f"h{i}-", 1) for i, n in enumerate(names)})
    config = make_config(short_dir, [ResourceConfig(n, "m", health_interval_s=0.1)
                                     for n in names])

    async def body():
        async with kubelet_and_host(config, {"m": driver}):
            before = driver.scans
            await asyncio.sleep(1.0)  # the window counted; load can only lower the count
            return driver.scans - before

    scans = run(body())
    # One timer: ~10 in the window. A timer per resource: ~40.
    assert 1 <= scans <= 14, scans
