"""Inventory rules without sockets, a host or a kubelet: operator drains, replicas, the
vanished-device grace, sanitising and a failing driver, on an ``Inventory`` fed by an
in-memory driver. ``Inventory.scan`` is a coroutine (it runs the driver in its thread), so each
scan is one ``asyncio.run``; the rules under test are the synchronous steps after it
(``set_drains``, ``set_resources``, ``expire_vanished``) and need no loop. The same rules
reaching the kubelet are in tests/test_drain.py, tests/test_live_changes.py, tests/test_host.py.
"""

from __future__ import annotations

import asyncio
from typing import Iterator, List

import pytest

from device_plugin_host_testing.drivers import MemoryDriver, make_devices
from host.core.hostfs import HostFS
from host.core.isolation import DriverCalls
from host.core.model import Device, Health, ResourceConfig
from host.inventory import Inventory

NAME = "example.com/x"


@pytest.fixture
def driver() -> MemoryDriver:
    return MemoryDriver("m", {NAME: make_devices("x", 3)})


@pytest.fixture
def calls() -> Iterator[DriverCalls]:
    calls = DriverCalls()
    yield calls
    calls.shutdown()


def inventory(fake_tree, driver, calls, *resources: ResourceConfig,
              grace: float = 0.0) -> Inventory:
    fake_tree.numa_nodes(2)
    return Inventory(HostFS(fake_tree.root), {"m": driver},
                     list(resources) or [ResourceConfig(NAME, "m")], calls,
                     discover_timeout_s=5, vanished_grace_s=grace)


def scan(inv: Inventory) -> set:
    return asyncio.run(inv.scan())


def health(inv: Inventory, name: str = NAME) -> List[tuple]:
    return [(d.id, d.health.value) for d in inv.devices[name]]


def test_a_drain_mark_turns_one_device_unhealthy_and_removing_it_heals(fake_tree, driver,
                                                                       calls):
    inv = inventory(fake_tree, driver, calls)
    assert scan(inv) == {NAME}
    assert inv.set_drains({(NAME, "x1"): "bad fan"}) == {NAME}
    (drained,) = [d for d in inv.devices[NAME] if d.id == "x1"]
    assert drained.health is Health.UNHEALTHY and "bad fan" in drained.health_reason
    assert inv.set_drains({(NAME, "x1"): "bad fan"}) == set()  # the same marks: no change
    assert inv.set_drains({}) == {NAME}
    assert all(h == "Healthy" for _, h in health(inv))


def test_replicas_are_advertised_as_id_k_and_a_drain_of_one_replica_is_only_it(
        fake_tree, driver, calls):
    inv = inventory(fake_tree, driver, calls, ResourceConfig(NAME, "m", replicas=2))
    scan(inv)
    assert [d.id for d in inv.devices[NAME]] == ["x0::0", "x0::1", "x1::0", "x1::1",
                                                 "x2::0", "x2::1"]
    assert {d.attributes["replica_of"] for d in inv.devices[NAME]} == {"x0", "x1", "x2"}
    inv.set_drains({(NAME, "x0::1"): "noisy"})
    assert [i for i, h in health(inv) if h == "Unhealthy"] == ["x0::1"]
    inv.set_drains({(NAME, "x2"): "whole card"})  # a mark on the device covers its replicas
    assert [i for i, h in health(inv) if h == "Unhealthy"] == ["x2::0", "x2::1"]


def test_a_replicas_change_rederives_ids_without_a_scan_and_without_grace(
        fake_tree, driver, calls):
    inv = inventory(fake_tree, driver, calls, grace=60)
    scan(inv)
    scans = driver.scans
    inv.set_resources([ResourceConfig(NAME, "m", replicas=3)])
    assert len(inv.devices[NAME]) == 9 and driver.scans == scans
    assert all(h == "Healthy" for _, h in health(inv))  # old ids retired, not "gone"


def test_a_vanished_device_stays_unhealthy_for_the_grace_then_goes(fake_tree, driver, calls):
    inv = inventory(fake_tree, driver, calls, grace=30)
    scan(inv)
    driver.devices[NAME] = driver.devices[NAME][:2]
    scan(inv)
    assert health(inv) == [("x0", "Healthy"), ("x1", "Healthy"), ("x2", "Unhealthy")]
    assert inv.devices[NAME][2].health_reason == "gone from the host"
    remaining = inv.next_expiry()
    assert remaining is not None and 29 < remaining <= 30
    assert inv.expire_vanished() == set()  # not yet
    inv.vanished_grace_s = 0.0  # the grace is over (rather than waiting 30 s)
    assert inv.expire_vanished() == {NAME}
    assert [d.id for d in inv.devices[NAME]] == ["x0", "x1"] and inv.next_expiry() is None


def test_a_device_back_within_the_grace_keeps_its_id_and_is_healthy(fake_tree, driver, calls):
    inv = inventory(fake_tree, driver, calls, grace=30)
    scan(inv)
    devices = list(driver.devices[NAME])
    driver.devices[NAME] = devices[:2]
    scan(inv)
    driver.devices[NAME] = devices
    scan(inv)
    assert health(inv) == [("x0", "Healthy"), ("x1", "Healthy"), ("x2", "Healthy")]
    assert inv.next_expiry() is None


def test_without_grace_a_vanished_device_goes_at_once(fake_tree, driver, calls):
    inv = inventory(fake_tree, driver, calls, grace=0)
    scan(inv)
    driver.devices[NAME] = driver.devices[NAME][1:]
    assert scan(inv) == {NAME}
    assert [d.id for d in inv.devices[NAME]] == ["x1", "x2"]


def test_garbage_from_a_driver_is_dropped_or_fixed_never_passed_on(fake_tree, driver, calls):
    driver.devices[NAME] = [Device(id="ok", numa_nodes=(1,)), Device(id="ok"),  # duplicate
                            Device(id="bad id"), "not a device",  # type: ignore[list-item]
                            Device(id="far", numa_nodes=(7,))]  # no NUMA node 7 here
    inv = inventory(fake_tree, driver, calls)
    scan(inv)
    assert [(d.id, d.numa_nodes) for d in inv.devices[NAME]] == [("ok", (1,)), ("far", ())]


def test_a_failing_driver_degrades_only_its_resources_with_its_error(fake_tree, driver,
                                                                     calls):
    inv = inventory(fake_tree, driver, calls)
    scan(inv)
    driver.fail = RuntimeError("sysfs went away")
    assert scan(inv) == {NAME}
    assert all(h == "Unhealthy" for _, h in health(inv))
    assert "sysfs went away" in inv.devices[NAME][0].health_reason
    assert inv.status["m"].errors == 1
    assert scan(inv) == set()  # the same error again changes nothing
    driver.fail = None
    scan(inv)
    assert all(h == "Healthy" for _, h in health(inv))


# -- the pure steps themselves (inventory/host_view.py, inventory/sanitize.py): no loop, no driver
def test_host_view_joins_reasons_drops_excluded_and_expands_replicas():
    from host.inventory.host_view import host_view

    res = ResourceConfig(NAME, "m", replicas=2)
    sick = Device(id="a", attributes={"pci_address": "0000:18:00.0"}).with_health(
        Health.UNHEALTHY, "driver says so")
    devices = [sick, Device(id="b"), Device(id="c")]
    out = host_view(res, devices, excluded={"c"}, aer={"0000:18:00.0": "AER errors rising"},
                    drains={(NAME, "b::1"): "noisy"})
    assert [(d.id, d.health.value) for d in out] == [
        ("a::0", "Unhealthy"), ("a::1", "Unhealthy"), ("b::0", "Healthy"),
        ("b::1", "Unhealthy")]
    assert out[0].health_reason == "driver says so; AER errors rising"
    assert out[3].health_reason == "drained by an operator: noisy"
    assert host_view(ResourceConfig(NAME, "m"), [Device(id="b")], excluded=None, aer={},
                     drains={}) == [Device(id="b")]


def test_sanitize_drops_garbage_and_unknown_numa_nodes_without_a_driver():
    from host.inventory.sanitize import sanitize

    out = sanitize("m", NAME, [Device(id="ok", numa_nodes=(1,)), Device(id="ok"),
                               Device(id="x\ny"), 42, Device(id="far", numa_nodes=(7,))],
                   (0, 1))
    assert [(d.id, d.numa_nodes) for d in out] == [("ok", (1,)), ("far", ())]
    assert sanitize("m", NAME, "not a list", None) == []
