"""DRA names: what upstream's validation accepts, stable, and never two ids on one name."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from host.dra.naming import (
    dra_device_name,
    driver_name,
    driver_name_error,
    is_dns_label,
    pool_name,
)
from host.sim.resource_validation import (
    dns_label_errors,
    driver_name_errors,
    pool_name_errors,
)


@pytest.mark.parametrize("device_id", [
    "0000:3b:00.0", "GPU-5fd0a3c2-9d1e-4b6a-8f00-0123456789ab", "1-2.3:1.0", "mlx5_0",
    "ttyUSB0", "region0/port1", "x" * 200, "::", "-a-", "0000:3b:00.0::3"])
def test_device_names_are_dns_labels_the_server_accepts(device_id):
    name = dra_device_name(device_id)
    assert is_dns_label(name)
    assert dns_label_errors(name, "f") == []
    assert dra_device_name(device_id) == name  # stable


def test_an_id_that_is_a_label_stays_readable():
    assert dra_device_name("gpu0") == "gpu0"
    assert dra_device_name("0000:3b:00.0").startswith("0000-3b-00-0-")


@given(st.text(min_size=1, max_size=80))
def test_distinct_ids_get_distinct_names(device_id):
    name = dra_device_name(device_id)
    assert is_dns_label(name)
    # Mangled names carry a hash of the id: the case-folded twin of an id is another name.
    if device_id != device_id.upper() and not is_dns_label(device_id.upper()):
        assert dra_device_name(device_id.upper()) != name


def test_case_twins_do_not_collide():
    assert dra_device_name("AbC") != dra_device_name("abc")


@pytest.mark.parametrize("resource", ["nvidia.com/gpu", "example.com/My_Dev", "a.b/" + "x" * 63])
def test_pool_names_pass_upstream_pool_validation(resource):
    name = pool_name(resource, "worker-1.example")
    assert pool_name_errors(name, "spec.pool.name") == []
    assert name.startswith("worker-1.example/")


def test_pool_name_rejects_a_bad_node_name():
    with pytest.raises(ValueError):
        pool_name("nvidia.com/gpu", "Not_A_Node")


@pytest.mark.parametrize("resource", ["nvidia.com/gpu", "amd.com/gpu", "example.com/" + "y" * 63,
                                      "intel.com/Sriov_Net"])
def test_derived_driver_names_pass_upstream_driver_validation(resource):
    name = driver_name(resource, None)
    assert driver_name_errors(name, "spec.driver") == []
    assert len(name) <= 63
    assert name.endswith(".device-plugin-host.io")


def test_two_vendors_gpus_get_two_drivers():
    assert driver_name("nvidia.com/gpu", None) == "gpu.nvidia.com.device-plugin-host.io"
    assert driver_name("nvidia.com/gpu", None) != driver_name("amd.com/gpu", None)


def test_configured_driver_name_is_validated():
    assert driver_name("nvidia.com/gpu", "gpu.example.com") == "gpu.example.com"
    with pytest.raises(ValueError, match="dra_driver_name"):
        driver_name("nvidia.com/gpu", "not a name")
    assert driver_name_error("x" * 64)
    assert driver_name_error("Upper.Example") == "must be lower case"
