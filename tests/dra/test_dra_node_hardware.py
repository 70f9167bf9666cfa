"""Footprints from Device facts: parent and partitions overlap, sibling partitions do not,
non-PCI devices overlap on a device node no other device of their pool has; and the taint
effect of a health reason and tolerations as upstream matches them."""

from __future__ import annotations

from host.core.model import Device, DeviceNode
from host.dra import hardware, taints


def _amd(index=None):
    attributes = {"pci_address": "0000:0c:00.0", "partition_mode": "CPX" if index is not None
                  else "SPX"}
    nodes = [DeviceNode("/dev/kfd")]
    if index is not None:
        attributes["partition_index"] = str(index)
        nodes.append(DeviceNode(f"/dev/dri/renderD{128 + index}"))
    else:
        nodes.append(DeviceNode("/dev/dri/renderD128"))
    device_id = "0000:0c:00.0" if index is None else f"0000:0c:00.0-p{index}"
    return Device(id=device_id, attributes=attributes, device_nodes=tuple(nodes))


def test_amd_spx_overlaps_each_cpx_partition_and_partitions_do_not_overlap_each_other():
    spx, p0, p1 = (hardware.footprint(d, {}) for d in (_amd(), _amd(0), _amd(1)))
    assert hardware.conflict(spx, p1) == "PCI function 0000:0c:00.0 and its partition part:1"
    assert hardware.conflict(p0, spx) == "PCI function 0000:0c:00.0 and its partition part:0"
    assert hardware.conflict(p0, p1) is None
    assert hardware.conflict(p0, p0) == "the same PCI function 0000:0c:00.0#part:0"
    other_gpu = hardware.footprint(Device(id="b", attributes={"pci_address": "0000:0d:00.0"}),
                                   {})
    assert hardware.conflict(spx, other_gpu) is None


def test_non_pci_devices_overlap_on_their_own_nodes_not_on_control_nodes():
    pool = [Device(id=f"npu{i}", device_nodes=(DeviceNode(f"/dev/accel/accel{i}"),
                                               DeviceNode("/dev/npu-ctl"))) for i in range(2)]
    counts = hardware.node_counts(pool)
    a, b = (hardware.footprint(d, counts) for d in pool)
    assert a == ("node:/dev/accel/accel0",) and hardware.conflict(a, b) is None
    # another resource exposing the same character device (a second pool)
    usb = Device(id="serial-x", device_nodes=(DeviceNode("/dev/accel/accel0"),))
    assert hardware.conflict(hardware.footprint(usb, hardware.node_counts([usb])), a) == \
        "the same device node /dev/accel/accel0"


def test_replicas_are_shared_by_design():
    r0 = Device(id="g0::0", attributes={"replica_of": "g0", "pci_address": "0000:01:00.0"})
    r1 = Device(id="g0::1", attributes={"replica_of": "g0", "pci_address": "0000:01:00.0"})
    assert hardware.conflict(hardware.footprint(r0, {}), hardware.footprint(r1, {})) is None
    assert hardware.conflict(hardware.footprint(r0, {}), hardware.footprint(r0, {}))


def test_taint_effects_and_what_cannot_work():
    assert taints.effect("drained by an operator: maintenance") == "NoSchedule"
    assert taints.effect("ECC errors") == "NoSchedule"
    assert taints.effect("no kernel driver bound (expected nvidia)") == "NoExecute"
    assert taints.effect("ECC errors; device node /dev/nvidia3 missing") == "NoExecute"
    assert taints.effect("gone from the host") == "NoExecute"
    assert taints.unusable("drained by an operator: x; device node /dev/nvidia3 missing") == \
        "device node /dev/nvidia3 missing"
    assert taints.unusable("no kernel driver bound (expected nvidia)") is None


def test_tolerations_match_as_upstream():
    taint = {"key": taints.TAINT_KEY, "value": "ECC-errors", "effect": "NoSchedule"}
    assert taints.tolerates({"operator": "Exists"}, taint)
    assert taints.tolerates({"key": taints.TAINT_KEY, "operator": "Exists"}, taint)
    assert taints.tolerates({"key": taints.TAINT_KEY, "value": "ECC-errors"}, taint)
    assert not taints.tolerates({"key": taints.TAINT_KEY, "value": "other"}, taint)
    assert not taints.tolerates({"operator": "Exists", "effect": "NoExecute"}, taint)
    assert not taints.tolerates({"key": "x", "operator": "Exists"}, taint)
    assert not taints.tolerates({"key": taints.TAINT_KEY, "operator": "Bogus"}, taint)
    claim = {"spec": {"devices": {"requests": [
        {"name": "gpu", "firstAvailable": [
            {"name": "big", "tolerations": [{"operator": "Exists"}]},
            {"name": "small"}]}]}}}
    assert taints.tolerations_of({"request": "gpu/big"}, claim) == [{"operator": "Exists"}]
    assert taints.tolerations_of({"request": "gpu/small"}, claim) == []
    assert taints.tolerations_of({"request": "gpu/small", "tolerations": [{"key": "k"}]},
                                 claim) == [{"key": "k"}]


def test_the_published_taint_is_the_one_prepare_checks():
    from host.core.model import Health
    from host.dra import slices

    for reason in ("drained by an operator: x", "device node /dev/g missing"):
        device = Device(id="g").with_health(Health.UNHEALTHY, reason)
        [published] = slices.slice_device(device, taint=True)["taints"]
        assert published == taints.device_taint(device)
