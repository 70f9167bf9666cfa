"""Pure parts of serving, without sockets: ``Snapshot.update`` (what counts as a change the
kubelet must see, host/kubelet/snapshot.py), overlap detection between resources
(host/core/overlap.py) and the reloader's "empty file" decision (host/cli/reload.py). The
socket-level behaviour is in tests/test_host.py, tests/test_overlap.py and tests/test_reload.py."""

from __future__ import annotations

import asyncio
import random
from dataclasses import replace

from host.cli.reload import is_empty
from host.core.model import Device, Health, ResourceConfig
from host.core.overlap import Overlap, claim_keys, find_overlaps
from host.kubelet.protocol.convert import framed_device, snapshot_payload
from host.kubelet.snapshot import Snapshot


def dev(i: int, **extra) -> Device:
    return Device(id=f"d{i}", numa_nodes=(0,), **extra)


# -- Snapshot.update -------------------------------------------------------------------------
def test_first_update_is_a_change_and_bumps_the_version():
    snap = Snapshot()
    assert snap.update([dev(0), dev(1)]) is True
    assert snap.version == 1 and len(snap) == 2 and snap.device("d1") == dev(1)


def test_same_devices_again_are_no_change_and_keep_the_payload():
    snap = Snapshot()
    snap.update([dev(0), dev(1)])
    payload = snap.payload
    assert snap.update([dev(0), dev(1)]) is False  # equal, rebuilt objects
    assert snap.version == 1 and snap.payload is payload


def test_what_the_kubelet_does_not_see_is_no_change_but_is_kept():
    snap = Snapshot()
    snap.update([dev(0)])
    changed = Device(id="d0", numa_nodes=(0,), attributes={"serial": "x"})
    assert snap.update([changed]) is False
    assert snap.device("d0").attributes == {"serial": "x"}  # Allocate reads the new one


def test_health_numa_order_additions_and_removals_are_changes():
    snap = Snapshot()
    snap.update([dev(0), dev(1)])
    steps = [
        [dev(0).with_health(Health.UNHEALTHY, "x"), dev(1)],
        [Device(id="d0", numa_nodes=(1,)), dev(1)],
        [dev(1), Device(id="d0", numa_nodes=(1,))],
        [dev(1)],
        [dev(1), dev(2)],
    ]
    for version, devices in enumerate(steps, start=2):
        assert snap.update(devices) is True, devices
        assert snap.version == version
        assert [d.id for d in snap.devices] == [d.id for d in devices]


def test_payload_is_always_the_list_encoded_afresh_whatever_the_edit():
    # The payload is spliced from the previous one (host/kubelet/snapshot.py): after any mix of
    # flips, rebuilt objects, hot-plugs, removals and reorders it must be byte for byte what
    # encoding the new list from scratch gives, and a change exactly when that differs.
    rng = random.Random(15)

    def wire(devices):
        return [(d.id, d.health, d.numa_nodes) for d in devices]

    for _ in range(300):
        current = [Device(id=f"d{i}", numa_nodes=(i % 2,)) for i in range(rng.randint(0, 30))]
        snap = Snapshot()
        snap.update(current)
        for _ in range(8):
            new = list(current)
            for _ in range(rng.randint(0, 4)):
                edit = rng.randrange(6)
                if edit == 0 and new:
                    at = rng.randrange(len(new))
                    new[at] = new[at].with_health(Health.UNHEALTHY, "x") if new[at].healthy \
                        else new[at].with_health(Health.HEALTHY)
                elif edit == 1 and new:
                    new = [replace(d) for d in new]
                elif edit == 2:
                    fresh = Device(id=f"n{rng.randrange(60)}", numa_nodes=(1,))
                    if fresh.id not in {d.id for d in new}:
                        new.insert(rng.randint(0, len(new)), fresh)
                elif edit == 3 and new:
                    del new[rng.randrange(len(new))]
                elif edit == 4 and len(new) > 1:
                    a, b = rng.randrange(len(new)), rng.randrange(len(new))
                    new[a], new[b] = new[b], new[a]
                elif edit == 5 and new:
                    at = rng.randrange(len(new))
                    new[at] = replace(new[at], numa_nodes=(0, 1))
            version = snap.version
            assert snap.update(new) is (wire(new) != wire(current))
            assert snap.version == version + (wire(new) != wire(current))
            assert snap.payload == snapshot_payload(framed_device(d) for d in new)
            assert snap.devices == new and all(snap.device(d.id) is d for d in new)
            current = new


def test_repeated_ids_keep_the_first_place_and_the_last_record():
    snap = Snapshot()
    snap.update([dev(0), dev(1)])
    later = dev(0).with_health(Health.UNHEALTHY, "x")
    assert snap.update([dev(0), dev(1), later]) is True
    assert [d.id for d in snap.devices] == ["d0", "d1"] and snap.device("d0") is later
    assert snap.payload == snapshot_payload(framed_device(d) for d in [later, dev(1)])


def test_next_payload_wakes_on_a_change_only():
    snap = Snapshot()
    snap.update([dev(0)])

    async def scenario():
        version, _ = await snap.next_payload(0)  # newer already: no wait
        assert version == 1
        waiter = asyncio.ensure_future(snap.next_payload(1))
        await asyncio.sleep(0)
        snap.update([dev(0)])  # no change: the waiter keeps waiting
        await asyncio.sleep(0)
        assert not waiter.done()
        snap.update([dev(0), dev(1)])
        assert (await asyncio.wait_for(waiter, 5))[0] == 2

    asyncio.run(scenario())


# -- overlap detection ---------------------------------------------------------------------
def res(name: str, driver: str = "gpu", **extra) -> ResourceConfig:
    return ResourceConfig(name, driver, **extra)


def _find(resources, reported):
    keys = {r.name: frozenset(k for d in reported.get(r.name, ()) for k in
                              claim_keys(r.driver, d)) for r in resources}
    return find_overlaps(resources, reported, keys)


def test_no_overlap_when_resources_claim_different_devices():
    a, b = res("x.com/a"), res("x.com/b")
    excluded, overlaps = _find([a, b], {"x.com/a": [dev(0)], "x.com/b": [dev(1)]})
    assert excluded == {} and overlaps == []


def test_the_later_resource_leaves_a_shared_device_to_the_earlier_one():
    a, b = res("x.com/a"), res("x.com/b")
    excluded, overlaps = _find([a, b], {"x.com/a": [dev(0), dev(1)],
                                        "x.com/b": [dev(1), dev(2)]})
    assert excluded == {"x.com/b": frozenset({"d1"})}
    assert overlaps == [Overlap("x.com/a", "x.com/b", ("d1",))]


def test_shared_with_on_either_side_allows_the_overlap():
    for a, b in [(res("x.com/a", shared_with=("x.com/b",)), res("x.com/b")),
                 (res("x.com/a"), res("x.com/b", shared_with=("x.com/a",)))]:
        assert _find([a, b], {"x.com/a": [dev(0)], "x.com/b": [dev(0)]}) == ({}, [])


def test_one_pci_function_is_one_device_across_drivers_not_within_one():
    card = {"pci_address": "0000:18:00.0"}
    gpu, vfio = res("x.com/gpu", "gpu"), res("x.com/vfio", "pci")
    excluded, overlaps = _find([gpu, vfio], {
        "x.com/gpu": [Device(id="GPU-1", attributes=card)],
        "x.com/vfio": [Device(id="0000:18:00.0", attributes=card)]})
    assert excluded == {"x.com/vfio": frozenset({"0000:18:00.0"})}
    assert overlaps[0].first == "x.com/gpu"
    # MIG slices of one card carry its address: two profiles of one driver do not overlap.
    mig1, mig2 = res("x.com/mig-1g"), res("x.com/mig-2g")
    assert _find([mig1, mig2], {"x.com/mig-1g": [Device(id="MIG-a", attributes=card)],
                                "x.com/mig-2g": [Device(id="MIG-b", attributes=card)]}) == \
        ({}, [])


def test_claim_keys_are_made_only_when_needed_and_mean_the_same():
    # Without ``keys`` find_overlaps works from the reported devices alone (the host keeps
    # no claim key per device between scans); it must find exactly what the keys find,
    # including a driver named "pci", whose own keys share the PCI keys' prefix.
    card = {"pci_address": "0000:18:00.0"}
    resources = [res("x.com/gpu", "gpu"), res("x.com/vfio", "pci"), res("x.com/mig", "gpu"),
                 res("x.com/other", "usb"), res("x.com/shares", "gpu",
                                                 shared_with=("x.com/gpu",))]
    reported = {
        "x.com/gpu": [Device(id="GPU-1", attributes=card), dev(1)],
        "x.com/vfio": [Device(id="0000:18:00.0"), dev(1)],
        "x.com/mig": [Device(id="MIG-a", attributes=card), dev(1)],
        "x.com/other": [dev(1)],
        "x.com/shares": [Device(id="GPU-1"), dev(2)],
    }
    expected = _find(resources, reported)
    assert expected[0] == {"x.com/vfio": frozenset({"0000:18:00.0"}),
                           "x.com/mig": frozenset({"MIG-a", "d1"})}
    assert find_overlaps(resources, reported) == expected
    # Devices a resource's previous driver reported keep that driver's keys until a rescan:
    # x.com/mig's d1, reported by the usb driver, is the usb device x.com/other claims.
    reporters = {"x.com/mig": "usb"}
    keys = {r.name: frozenset(k for d in reported[r.name]
                              for k in claim_keys(reporters.get(r.name, r.driver), d))
            for r in resources}
    found = find_overlaps(resources, reported, reporters=reporters)
    assert found == find_overlaps(resources, reported, keys, reporters)
    assert found[0]["x.com/other"] == frozenset({"d1"})


def test_overlap_description_counts_what_it_does_not_show():
    assert Overlap("a", "b", ("d0",)).describe() == "1 device (d0)"
    many = Overlap("a", "b", tuple(f"d{i}" for i in range(7)))
    assert many.describe() == "7 devices (d0, d1, d2, d3, d4 and 2 more)"


# -- the reloader's decision on an empty file ----------------------------------------------
def test_only_whitespace_and_comments_count_as_an_empty_config():
    assert is_empty(b"") and is_empty(b"\n  \n# nothing\n   # still nothing\n")
    assert is_empty("\ufeff# bom\n".encode())
    assert not is_empty(b"[host]\n") and not is_empty(b"# c\nversion = 1\n")
