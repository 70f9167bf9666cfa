"""build_slices / device_attributes: every slice it builds passes upstream's validation (the
stand-in's rules), whatever odd facts a driver records."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from host.core.model import Device, Health
from host.dra.naming import dra_device_name
from host.dra.slices import (
    NUMA_NODE,
    attribute_key,
    build_slices,
    device_attributes,
    device_capacity,
    taint_value,
)
from host.sim.resource_validation import resource_slice_errors
from host.sysfs.pci import pcie_root

DRIVER = "gpu.example.com.device-plugin-host.io"


def test_numa_node_only_when_the_kernel_names_exactly_one():
    assert device_attributes(Device(id="a", numa_nodes=(1,)))[NUMA_NODE] == {"int": 1}
    assert NUMA_NODE not in device_attributes(Device(id="a", numa_nodes=()))  # numa_node -1
    assert NUMA_NODE not in device_attributes(Device(id="a", numa_nodes=(0, 1)))


def test_long_values_are_left_out_not_truncated():
    attributes = device_attributes(Device(id="a", attributes={"afu_ids": "f" * 65, "ok": "v"}))
    assert "afu_ids" not in attributes and attributes["ok"] == {"string": "v"}


def test_keys_become_c_identifiers():
    assert attribute_key("drm-card") == "drm_card"
    assert attribute_key("9x") == "_9x"
    assert len(attribute_key("k" * 40)) == 32


def test_capacity_in_binary_units_when_exact():
    def memory(raw):
        return device_capacity(Device(id="a", attributes={"memory_bytes": raw}))

    assert memory(str(80 << 30)) == {"memory": {"value": "80Gi"}}
    assert memory("1536") == {"memory": {"value": "1536"}}
    assert memory("nope") == {} and memory("0") == {}


def test_taint_values_are_label_values():
    assert taint_value("XID 79: fallen off the bus") == "XID-79-fallen-off-the-bus"
    assert taint_value("") == "unhealthy"
    assert len(taint_value("x" * 100)) == 63


def test_pcie_root_from_the_sysfs_path():
    assert pcie_root("/sys/devices/pci0000:00/0000:00:01.0/0000:3b:00.0") == "pci0000:00"
    assert pcie_root("/sys/devices/pci10000:80/10000:80:01.0") == "pci10000:80"  # VMD
    assert pcie_root("/sys/devices/platform/foo") is None


def test_slice_names_are_stable_and_distinct_per_pool():
    one = build_slices(DRIVER, "node-a", "node-a/example.com/gpu", [], 1)
    two = build_slices(DRIVER, "node-a", "node-a/example.com/other", [], 1)
    assert one[0]["metadata"]["name"] != two[0]["metadata"]["name"]
    assert one == build_slices(DRIVER, "node-a", "node-a/example.com/gpu", [], 1)


def test_replicas_of_one_device_are_one_dra_device():
    devices = [Device(id="gpu0"), Device(id="gpu0")]
    assert len(build_slices(DRIVER, "n", "n/p", devices, 1)[0]["spec"]["devices"]) == 1


facts = st.dictionaries(st.text(min_size=1, max_size=40), st.text(max_size=80), max_size=40)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.text(min_size=1, max_size=70), facts,
                          st.lists(st.integers(0, 7), max_size=2), st.booleans()),
                max_size=140),
       st.booleans())
def test_whatever_the_driver_records_the_slices_are_valid(records, taint):
    devices = [Device(id=i, attributes=a, numa_nodes=tuple(n),
                      health=Health.HEALTHY if ok else Health.UNHEALTHY,
                      health_reason="" if ok else "bad: " + i)
               for i, a, n, ok in records]
    slices = build_slices(DRIVER, "node-a", "node-a/example.com/gpu", devices, 3,
                          node_uid="6b7c3a4e-1d2f-4a5b-9c8d-0e1f2a3b4c5d",
                          taint_unhealthy=taint)
    for obj in slices:
        assert resource_slice_errors(obj) == [], obj
    published = {d["name"] for s in slices for d in s["spec"]["devices"]}
    expected = {dra_device_name(d.id) for d in devices if d.healthy or taint}
    assert published == expected
    assert {s["spec"]["pool"]["resourceSliceCount"] for s in slices} == {len(slices)}


def test_string_limits_count_utf8_bytes_as_the_api_server_does():
    # validateDeviceAttribute: len(*StringValue) > 64 in Go counts bytes. 63 characters with
    # one "®" (2 bytes) is 64 bytes: fine; 64 characters with one is 65 bytes: a 422.
    fits = "Intel® " + "x" * 56
    too_long = fits + "x"
    assert len(fits.encode()) == 64 and len(too_long) == 64
    device = Device(id="usb-1", attributes={"product": fits, "manufacturer": too_long})
    attributes = device_attributes(device)
    assert attributes["product"] == {"string": fits}
    assert "manufacturer" not in attributes
    [piece] = build_slices(DRIVER, "node-a", "node-a/example.com/usb", [device], 1)
    assert resource_slice_errors(piece) == []
    piece["spec"]["devices"][0]["attributes"]["manufacturer"] = {"string": too_long}
    assert [e.field for e in resource_slice_errors(piece)] == [
        "spec.devices[0].attributes[manufacturer].string"]
