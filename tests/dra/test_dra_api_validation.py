"""The stand-in's ResourceSlice rules, each from upstream's validation.go (so a slice our
builder gets wrong fails here as it would on a real server), and the object semantics of the
registry (resourceVersion, generation, no-op updates, generateName, 400s)."""

from __future__ import annotations

import http.client
import json

import pytest

from host.sim.apiserver import ApiServerStandIn, parse_field_selector
from host.sim.resource_validation import (
    DecodeError,
    qualified_name_errors,
    resource_slice_errors,
)


def good(**spec):
    base = {"driver": "gpu.example.com", "nodeName": "node-a",
            "pool": {"name": "node-a", "generation": 0, "resourceSliceCount": 1},
            "devices": [{"name": "gpu0"}]}
    base.update(spec)
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
            "metadata": {"name": "s1"}, "spec": base}


def fields(obj, old=None):
    return [e.field for e in resource_slice_errors(obj, old)]


def test_a_good_slice_passes():
    assert resource_slice_errors(good()) == []


@pytest.mark.parametrize("key, ok", [
    ("model", True), ("_x9", True), ("gpu.example.com/model", True),
    ("resource.kubernetes.io/pcieRoot", True), ("9lives", False), ("has-dash", False),
    ("a/b/c", False), ("/model", False), ("example.com/", False), ("x" * 33, False),
    ("Upper.Example.COM/model", True),  # the domain is checked lower-cased (CSI driver rule)
])
def test_attribute_keys(key, ok):
    assert (qualified_name_errors(key, "f") == []) is ok


@pytest.mark.parametrize("value, ok", [
    ({"int": 3}, True), ({"bool": False}, True), ({"string": "x" * 64}, True),
    ({"string": "x" * 65}, False), ({"version": "1.2.3-rc.1+build.5"}, True),
    ({"version": "1.2"}, False), ({"version": "01.2.3"}, False), ({}, False),
    ({"int": 1, "string": "1"}, False),
])
def test_attribute_values(value, ok):
    obj = good(devices=[{"name": "d", "attributes": {"a": value}}])
    assert (resource_slice_errors(obj) == []) is ok


def test_wrong_json_types_are_decode_errors():
    with pytest.raises(DecodeError):
        resource_slice_errors(good(devices=[{"name": "d", "attributes": {"a": {"int": "3"}}}]))
    with pytest.raises(DecodeError):
        resource_slice_errors(good(devices=[{"name": "d", "capacity": {"m": {"value": "lots"}}}]))


@pytest.mark.parametrize("quantity", ["40Gi", "1", "0.5", "100m", "1e3", "2E+9"])
def test_capacity_quantities(quantity):
    assert resource_slice_errors(good(devices=[{"name": "d", "capacity": {
        "memory": {"value": quantity}}}])) == []


def test_attributes_and_capacities_are_limited_to_32():
    attributes = {f"a{i}": {"int": i} for i in range(31)}
    ok = good(devices=[{"name": "d", "attributes": attributes,
                        "capacity": {"memory": {"value": "1Gi"}}}])
    assert resource_slice_errors(ok) == []
    attributes["a31"] = {"int": 31}
    assert fields(good(devices=[{"name": "d", "attributes": attributes,
                                 "capacity": {"memory": {"value": "1Gi"}}}])) == [
        "spec.devices[0]"]


def test_128_devices_but_64_once_one_is_tainted():
    devices = [{"name": f"d{i}"} for i in range(128)]
    assert resource_slice_errors(good(devices=devices)) == []
    devices[0]["taints"] = [{"key": "example.com/bad", "effect": "NoSchedule"}]
    errors = resource_slice_errors(good(devices=devices))
    assert [str(e) for e in errors] == [
        "spec.devices: Too many: 128: must have at most 64 items"]


@pytest.mark.parametrize("taint, ok", [
    ({"key": "example.com/unhealthy", "value": "xid-79", "effect": "NoSchedule"}, True),
    ({"key": "example.com/unhealthy", "effect": "NoExecute"}, True),
    ({"key": "example.com/unhealthy", "effect": "Sometimes"}, False),
    ({"key": "example.com/unhealthy"}, False),
    ({"key": "", "effect": "NoSchedule"}, False),
    ({"key": "k", "value": "has spaces", "effect": "NoSchedule"}, False),
])
def test_taints(taint, ok):
    assert (resource_slice_errors(good(devices=[{"name": "d", "taints": [taint]}])) == []) is ok


def test_pool_node_and_driver_rules():
    assert fields(good(pool={"name": "", "generation": 0, "resourceSliceCount": 1})) == [
        "spec.pool.name"]
    assert fields(good(pool={"name": "a/b.c/d", "generation": -1,
                             "resourceSliceCount": 1})) == ["spec.pool.generation"]
    assert "spec" in fields(good(nodeName=None))  # exactly one of nodeName, ... is required
    assert "spec" in fields(good(allNodes=True))  # and only one
    assert fields(good(driver="")) == ["spec.driver"]


def test_update_keeps_driver_pool_and_node():
    old = good()
    for spec in ({"driver": "other.example.com"}, {"nodeName": "node-b"},
                 {"pool": {"name": "node-b", "generation": 1, "resourceSliceCount": 1}}):
        assert fields(good(**spec), old) != []


def test_duplicate_device_names():
    assert fields(good(devices=[{"name": "d"}, {"name": "e"}, {"name": "d"}])) == [
        "spec.devices[2]"]


def _request(api, method, path, body=None):
    conn = http.client.HTTPConnection(api.host, api.port, timeout=5)
    try:
        conn.request(method, path, body=json.dumps(body) if body is not None else None,
                     headers={"Content-Type": "application/json",
                              "Authorization": f"Bearer {api.TOKEN}"})
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


SLICES = "/apis/resource.k8s.io/v1/resourceslices"


def test_registry_semantics():
    with ApiServerStandIn() as api:
        obj = good()
        obj["metadata"] = {"generateName": "node-a-gpu-"}
        status, created = _request(api, "POST", SLICES, obj)
        assert status == 201
        name = created["metadata"]["name"]
        assert name.startswith("node-a-gpu-") and len(name) == len("node-a-gpu-") + 5
        assert created["metadata"]["generation"] == 1
        # Create with a resourceVersion: 400, as the generic registry answers.
        again = good()
        again["metadata"] = {"name": "s2", "resourceVersion": "5"}
        assert _request(api, "POST", SLICES, again)[0] == 400
        # Same name twice: 409 AlreadyExists.
        dup = good()
        dup["metadata"] = {"name": name}
        status, body = _request(api, "POST", SLICES, dup)
        assert (status, body["reason"]) == (409, "AlreadyExists")
        # A no-op update keeps resourceVersion and generation; a change bumps both.
        status, same = _request(api, "PUT", f"{SLICES}/{name}", created)
        assert status == 200
        assert same["metadata"]["resourceVersion"] == created["metadata"]["resourceVersion"]
        created["spec"]["pool"]["generation"] = 1
        status, changed = _request(api, "PUT", f"{SLICES}/{name}", created)
        assert changed["metadata"]["generation"] == 2
        assert changed["metadata"]["resourceVersion"] != created["metadata"]["resourceVersion"]
        # An update without resourceVersion is unconditional (AllowUnconditionalUpdate).
        del changed["metadata"]["resourceVersion"]
        changed["spec"]["devices"] = []
        assert _request(api, "PUT", f"{SLICES}/{name}", changed)[0] == 200
        # The name in the body must be the one in the URL.
        assert _request(api, "PUT", f"{SLICES}/other", changed)[0] == 400
        # A wrong kind or apiVersion in the body is a 400.
        wrong = dict(changed, apiVersion="resource.k8s.io/v1beta1")
        assert _request(api, "PUT", f"{SLICES}/{name}", wrong)[0] == 400
        status, body = _request(api, "GET", "/apis/resource.k8s.io/v1/nope")
        assert status == 404 and body["kind"] == "Status"


def test_field_selectors():
    assert parse_field_selector("spec.driver=a,spec.nodeName!=b") == [
        ("spec.driver", "a", True), ("spec.nodeName", "b", False)]
    with pytest.raises(ValueError):
        parse_field_selector("spec.driver")
    with ApiServerStandIn() as api:
        for node in ("n1", "n2"):
            obj = good(nodeName=node, pool={"name": node, "generation": 0,
                                            "resourceSliceCount": 1})
            obj["metadata"] = {"name": f"s-{node}"}
            assert _request(api, "POST", SLICES, obj)[0] == 201
        _status, body = _request(api, "GET", f"{SLICES}?fieldSelector=spec.nodeName%3Dn2")
        assert [i["metadata"]["name"] for i in body["items"]] == ["s-n2"]
        _status, body = _request(api, "GET", f"{SLICES}?fieldSelector=spec.nodeName!%3Dn2")
        assert [i["metadata"]["name"] for i in body["items"]] == ["s-n1"]


def test_generate_name_is_cut_to_58_characters_as_upstream_does():
    # apiserver/pkg/storage/names: maxGeneratedNameLength = 63 - 5, whatever the resource.
    with ApiServerStandIn() as api:
        obj = good()
        obj["metadata"] = {"generateName": "n" * 100 + "-"}
        status, created = _request(api, "POST", SLICES, obj)
        assert status == 201
        assert created["metadata"]["name"].startswith("n" * 58)
        assert len(created["metadata"]["name"]) == 63


def test_a_metadata_only_update_is_a_write_without_a_new_generation():
    # registry: any change is stored with a new resourceVersion; only a spec change bumps
    # metadata.generation (resourceslice strategy PrepareForUpdate).
    with ApiServerStandIn() as api:
        obj = good()
        obj["metadata"] = {"name": "s1"}
        status, created = _request(api, "POST", SLICES, obj)
        assert status == 201
        created["metadata"]["labels"] = {"touched": "yes"}
        status, labelled = _request(api, "PUT", f"{SLICES}/s1", created)
        assert status == 200
        assert labelled["metadata"]["labels"] == {"touched": "yes"}
        assert labelled["metadata"]["generation"] == created["metadata"]["generation"]
        assert labelled["metadata"]["resourceVersion"] != created["metadata"]["resourceVersion"]
        # the stale resourceVersion is now a conflict
        assert _request(api, "PUT", f"{SLICES}/s1", created)[0] == 409
