"""A GPU and its partitions (MIG devices, AMD compute partitions) in one pool with shared
counters (KEP-4815): what the GPU driver records, the slices built from it, and what the API
server keeps of them (real one with KUBEBUILDER_ASSETS, else the stand-in); a server that
drops the fields gets today's model, told once."""

from __future__ import annotations

import asyncio
import copy
import logging
from typing import Any, Dict, List

import pytest

from device_plugin_host_testing.machines import load_machine
from drivers.gpu.driver import GpuDriver
from drivers.gpu.nvml import NvmlMig, NvmlView
from host.core.hostfs import HostFS
from host.core.model import Device, Health, ResourceConfig
from host.dra.kube import KubeClient
from host.dra.naming import dra_device_name, driver_name, pool_name
from host.dra.publisher import SlicePublisher
from host.dra.slices import (
    MAX_COUNTER_SETS,
    MAX_DEVICES_WITH_TAINTS,
    build_slices,
    has_taints,
    same_content,
)
from host.sim.apiserver import ApiServerStandIn, RealApiServer, kube_api, kubebuilder_assets
from host.sim.fake_gpu import (
    add_mig_config_caps,
    add_mig_device,
    add_mig_minors_table,
    add_nvidia_control_nodes,
    add_nvidia_gpu,
)
from host.sim.tree import FakeTree

__all__ = ["kube_api"]

NODE = "gpu-node-1"
NVIDIA_DRA = ResourceConfig("nvidia.com/gpu", "gpu", {"vendor": "0x10de"},
                            settings={"mig_strategy": "mixed"}, api="dra")
AMD_DRA = ResourceConfig("amd.com/gpu", "gpu", {"vendor": "0x1002"}, api="dra")
GPU0, GPU1 = "0000:18:00.0", "0000:2a:00.0"


class FixedNvml:
    def __init__(self, view: NvmlView) -> None:
        self.view = view

    def read(self) -> NvmlView:
        return self.view


NO_NVML = FixedNvml(NvmlView(False, "not installed"))


def _devices(root: str, resource: ResourceConfig, nvml: Any = NO_NVML) -> List[Device]:
    return list(GpuDriver(nvml=nvml).discover(HostFS(root), [resource])[resource.name])


@pytest.fixture
def mig_tree(tmp_path) -> FakeTree:
    """GPU minor 0 in MIG mode with two MIG devices (gi1/ci0, gi2/ci0); GPU minor 1 whole."""
    fake = FakeTree(tmp_path / "root")
    fake.numa_nodes(2)
    add_nvidia_control_nodes(fake)
    add_nvidia_gpu(fake, GPU0, minor=0, numa_node=0)
    add_nvidia_gpu(fake, GPU1, minor=1, numa_node=1)
    add_mig_minors_table(fake, gpus=2)
    add_mig_config_caps(fake)
    add_mig_device(fake, 0, 1, 0)
    add_mig_device(fake, 0, 2, 0)
    return fake


def _by_name(slices: List[Dict[str, Any]]) -> Dict[str, Dict[str, Any]]:
    return {d["name"]: d for s in slices for d in s["spec"].get("devices") or []}


def _counter_sets(slices: List[Dict[str, Any]]) -> Dict[str, Dict[str, Any]]:
    return {c["name"]: c["counters"] for s in slices for c in s["spec"].get("sharedCounters") or []}


# -- what the driver records ------------------------------------------------------------------

def test_a_dra_pool_holds_the_gpu_its_mig_devices_and_the_partitioned_parent(mig_tree):
    nvml = FixedNvml(NvmlView(True, mig_mode={GPU0: True, GPU1: False}, migs={
        (GPU0, 1, 0): NvmlMig("MIG-aaaaaaaa-1111-2222-3333-444444444444", "3g.40gb"),
        (GPU0, 2, 0): NvmlMig("MIG-bbbbbbbb-1111-2222-3333-444444444444", "4g.40gb")}))
    devices = {d.id: d for d in _devices(mig_tree.root, NVIDIA_DRA, nvml)}
    assert sorted(devices) == [GPU0, f"{GPU0}-gi1-ci0", f"{GPU0}-gi2-ci0", GPU1]
    parent, mig, whole = devices[GPU0], devices[f"{GPU0}-gi1-ci0"], devices[GPU1]
    assert parent.attributes["partitioned"] == "true" and parent.attributes["type"] == "gpu"
    assert whole.attributes["type"] == "gpu" and "partitioned" not in whole.attributes
    assert mig.attributes["type"] == "mig" and mig.attributes["parent"] == GPU0
    assert mig.attributes["profile"] == "3g.40gb"
    assert mig.attributes["parent_uuid"] == parent.attributes["uuid"]
    published = _by_name(build_slices("d.example.com", NODE, "p", list(devices.values()), 1))
    attributes = published[dra_device_name(mig.id)]["attributes"]
    # Numbers CEL can compare as numbers (they were strings).
    assert attributes["mig_gi"] == {"int": 1} and attributes["mig_ci"] == {"int": 0}
    assert attributes["mig_parent_minor"] == {"int": 0}
    assert attributes["profile"] == {"string": "3g.40gb"}
    assert attributes["type"] == {"string": "mig"}
    # The device plugin side (same resource, api device-plugin) never sees the parent, nor
    # MIG devices under "mixed".
    plain = ResourceConfig("nvidia.com/gpu", "gpu", {"vendor": "0x10de"},
                           settings={"mig_strategy": "mixed"})
    assert [d.id for d in _devices(mig_tree.root, plain, nvml)] == [GPU1]


def test_mig_selector_resources_under_dra_get_no_parent(mig_tree):
    resource = ResourceConfig("nvidia.com/mig-small", "gpu", {"vendor": "0x10de", "mig_gi": 1},
                              api="dra")
    assert [d.id for d in _devices(mig_tree.root, resource)] == [f"{GPU0}-gi1-ci0"]


def test_the_mig_mode_warning_is_logged_once_per_change(mig_tree, caplog):
    driver = GpuDriver(nvml=NO_NVML)
    host = HostFS(mig_tree.root)

    def warnings() -> List[str]:
        return [r.getMessage() for r in caplog.records if "is in MIG mode" in r.getMessage()]

    with caplog.at_level(logging.INFO, logger="drivers.gpu.driver"):
        for _ in range(5):
            driver.discover(host, [NVIDIA_DRA])
        assert len(warnings()) == 1
        add_mig_device(mig_tree, 0, 3, 0)  # a third MIG device: a change, told once
        for _ in range(3):
            driver.discover(host, [NVIDIA_DRA])
        assert len(warnings()) == 2 and "(3 MIG devices)" in warnings()[-1]
        for gi in (1, 2, 3):
            mig_tree.remove(f"/proc/driver/nvidia/capabilities/gpu0/mig/gi{gi}")
        for _ in range(3):
            driver.discover(host, [NVIDIA_DRA])
        left = [r.getMessage() for r in caplog.records if "left MIG mode" in r.getMessage()]
        assert left == [f"gpu {GPU0} left MIG mode: served whole again"]
        assert len(warnings()) == 2


def test_amd_cpx_partitions_name_their_gpu_and_profile(tmp_path):
    load_machine("mi300x-cpx-nps4", tmp_path)
    devices = _devices(str(tmp_path), AMD_DRA)
    parents = [d for d in devices if d.attributes.get("partitioned") == "true"]
    parts = [d for d in devices if d.attributes.get("type") == "partition"]
    assert len(parents) == 8 and len(parts) == 64
    for part in parts:
        assert part.attributes["parent"] in {p.id for p in parents}
        assert part.attributes["profile"] == "cpx_nps4"


# -- the slices -------------------------------------------------------------------------------

def _gpu(address: str, **extra: str) -> Device:
    return Device(id=address, attributes={"pci_address": address, "type": "gpu", **extra})


def _part(parent: str, index: int, healthy: bool = True) -> Device:
    return Device(id=f"{parent}-p{index}", attributes={
        "type": "partition", "parent": parent, "partition_index": str(index)},
        health=Health.HEALTHY if healthy else Health.UNHEALTHY,
        health_reason="" if healthy else "device node missing")


def test_the_parent_consumes_everything_and_each_partition_one():
    devices = [_gpu(GPU0, partitioned="true", device_minor="0"), _part(GPU0, 0),
               _part(GPU0, 1), _gpu(GPU1)]
    slices = build_slices("d.example.com", NODE, "p", devices, 1)
    assert [bool(s["spec"].get("sharedCounters")) for s in slices] == [False, True]
    assert "devices" not in slices[1]["spec"]  # a counter slice holds no devices
    assert all(s["spec"]["pool"]["resourceSliceCount"] == 2 for s in slices)
    name = dra_device_name(GPU0)
    assert _counter_sets(slices) == {name: {"partitions": {"value": "2"}}}
    by_name = _by_name(slices)
    assert by_name[name]["consumesCounters"] == [{"counterSet": name, "counters": {
        "partitions": {"value": "2"}}}]
    assert by_name[name]["attributes"]["partitioned"] == {"bool": True}
    assert by_name[name]["taints"] == [{"key": "device-plugin-host.io/partitioned",
                                        "value": "true", "effect": "NoSchedule"}]
    assert by_name[name]["attributes"]["device_minor"] == {"int": 0}
    part = by_name[dra_device_name(f"{GPU0}-p1")]
    assert part["consumesCounters"] == [{"counterSet": name,
                                         "counters": {"partitions": {"value": "1"}}}]
    assert part["attributes"]["partition_index"] == {"int": 1}
    assert "consumesCounters" not in by_name[dra_device_name(GPU1)]  # not partitioned


def test_a_partitioned_gpu_is_tainted_even_with_no_partitions():
    parent = _gpu(GPU0, partitioned="true")
    slices = build_slices("d.example.com", NODE, "p", [parent], 1)
    assert _counter_sets(slices)[dra_device_name(GPU0)] == {"partitions": {"value": "0"}}
    assert _by_name(slices)[dra_device_name(GPU0)]["taints"][0]["effect"] == "NoSchedule"
    untainted = build_slices("d.example.com", NODE, "p", [parent], 1, partition_taints=False)
    assert "taints" not in _by_name(untainted)[dra_device_name(GPU0)]


def test_no_consumption_exceeds_its_counter():
    """The allocator checks every counter set of the pool on each allocation: one negative
    counter (a parent allocated whole consuming more than there is) would block every
    partition of the pool, of every GPU."""
    devices = [_gpu(GPU0, partitioned="true"), _part(GPU0, 0), _part(GPU0, 1),
               _gpu(GPU1, partitioned="true"), _part(GPU1, 0)]
    slices = build_slices("d.example.com", NODE, "p", devices, 1)
    sets = _counter_sets(slices)
    for device in _by_name(slices).values():
        for consumption in device["consumesCounters"]:
            for counter, amount in consumption["counters"].items():
                available = sets[consumption["counterSet"]][counter]["value"]
                assert int(amount["value"]) <= int(available)


def test_server_set_taint_times_are_not_a_difference():
    devices = [_gpu(GPU0, partitioned="true"), _part(GPU0, 0)]
    desired = build_slices("d.example.com", NODE, "p", devices, 1)[0]
    stored = copy.deepcopy(desired)
    for device in stored["spec"]["devices"]:
        for taint in device.get("taints") or []:
            taint["timeAdded"] = "2026-12-05T13:00:00Z"
    assert same_content(desired, stored)
    stored["spec"]["devices"][0]["taints"][0]["effect"] = "NoExecute"
    assert not same_content(desired, stored)


def test_an_unhealthy_parent_stays_published_for_the_counts():
    parent = _gpu(GPU0, partitioned="true").with_health(Health.UNHEALTHY, "XID 79")
    slices = build_slices("d.example.com", NODE, "p", [parent, _part(GPU0, 0),
                                                       _part(GPU0, 1, healthy=False)], 1)
    assert sorted(_by_name(slices)) == sorted([dra_device_name(GPU0),
                                               dra_device_name(f"{GPU0}-p0")])


def test_without_counters_partitioned_parents_are_left_out():
    devices = [_gpu(GPU0, partitioned="true"), _part(GPU0, 0), _gpu(GPU1)]
    slices = build_slices("d.example.com", NODE, "p", devices, 1, counters=False)
    assert len(slices) == 1 and not _counter_sets(slices)
    by_name = _by_name(slices)
    assert sorted(by_name) == sorted([dra_device_name(f"{GPU0}-p0"), dra_device_name(GPU1)])
    assert not any("consumesCounters" in d for d in by_name.values())


def test_limits_64_devices_with_counters_and_8_counter_sets_a_slice():
    parents = [f"0000:{bus:02x}:00.0" for bus in range(1, 11)]
    devices = [d for p in parents for d in
               [_gpu(p, partitioned="true"), *(_part(p, i) for i in range(8))]]
    slices = build_slices("d.example.com", NODE, "p", devices, 1)
    device_slices = [s for s in slices if "devices" in s["spec"]]
    counter_slices = [s for s in slices if "sharedCounters" in s["spec"]]
    assert [len(s["spec"]["devices"]) for s in device_slices] == [64, 26]
    assert [len(s["spec"]["sharedCounters"]) for s in counter_slices] == [MAX_COUNTER_SETS, 2]
    assert max(len(s["spec"]["devices"]) for s in device_slices) <= MAX_DEVICES_WITH_TAINTS
    assert len({s["metadata"]["name"] for s in slices}) == 4


def test_one_dra_driver_name_per_vendor_for_the_gpu_driver():
    nvidia = driver_name("nvidia.com/gpu", None, "gpu")
    assert nvidia == "gpu.nvidia.com.device-plugin-host.io" == driver_name("nvidia.com/gpu", None)
    assert driver_name("nvidia.com/mig-1g.10gb", None, "gpu") == nvidia
    assert driver_name("nvidia.com/mig-3g.40gb", None, "gpu") == nvidia
    assert driver_name("amd.com/cpx_nps4", None, "gpu") == "gpu.amd.com.device-plugin-host.io"
    assert driver_name("gpu.intel.com/xe", None, "gpu") == \
        driver_name("gpu.intel.com/i915", None, "gpu") == "gpu.intel.com.device-plugin-host.io"
    # Other host drivers keep a name per resource; a configured name always wins.
    assert driver_name("intel.com/qat", None, "pci") == "qat.intel.com.device-plugin-host.io"
    assert driver_name("nvidia.com/mig-1g.10gb", "gpu.example.com", "gpu") == "gpu.example.com"


# -- against the API server -------------------------------------------------------------------

async def _publish(api: Any, pools: Dict[str, List[Device]], driver: str) -> SlicePublisher:
    client = KubeClient.from_settings(api.kubeconfig_path, timeout_s=5)
    publisher = SlicePublisher(client, NODE)
    for name, devices in pools.items():
        publisher.set_pool(driver, pool_name(name, NODE), devices)
    await publisher.start()
    try:
        assert await publisher.wait_synced(30)
        # Read back and found in sync (server-set fields such as a taint's timeAdded are no
        # difference): a republish lists each pool and writes nothing.
        before = publisher.requests
        publisher.republish()
        await asyncio.sleep(0)
        assert await publisher.wait_synced(30)
        assert publisher.requests - before == len(pools)
    finally:
        await publisher.stop()
        await client.close()
    return publisher


@pytest.mark.parametrize("machine,resource", [("hgx-h100-mig", NVIDIA_DRA),
                                              ("mi300x-cpx-nps4", AMD_DRA)])
def test_the_api_server_keeps_the_counters_as_published(kube_api, run, tmp_path, machine,
                                                        resource):
    load_machine(machine, tmp_path)
    devices = _devices(str(tmp_path), resource)
    driver = driver_name(resource.name, None, "gpu")
    kube_api.add_node(NODE)
    run(_publish(kube_api, {resource.name: devices}, driver))
    stored = kube_api.resource_slices(driver, NODE)
    # 1.36 keeps device taints (DRADeviceTaints, on by default); the stand-in, like 1.34 and
    # 1.35, drops them, and the publisher then writes the pool without them.
    kept = any(has_taints(s) for s in stored)
    assert kept == (isinstance(kube_api, RealApiServer) or kube_api.device_taints)
    wanted = build_slices(driver, NODE, pool_name(resource.name, NODE), devices, 1,
                          partition_taints=kept)
    assert len(stored) == len(wanted)
    assert _counter_sets(stored) == _counter_sets(wanted)
    assert _by_name(stored).keys() == _by_name(wanted).keys()
    by_stored = {s["metadata"]["name"]: s for s in stored}
    for want in wanted:  # as published, less the server's own taint timeAdded
        assert same_content(want, by_stored[want["metadata"]["name"]])
    parents = [d for d in devices if d.attributes.get("partitioned") == "true"]
    assert parents and len(_counter_sets(stored)) == len(parents)
    for parent in parents:
        name = dra_device_name(parent.id)
        children = [d for d in devices if d.attributes.get("parent") == parent.id]
        assert _counter_sets(stored)[name]["partitions"] == {"value": str(len(children))}
        for child in children:
            assert _by_name(stored)[dra_device_name(child.id)]["consumesCounters"][0][
                "counterSet"] == name
    for item in stored:
        assert not (item["spec"].get("devices") and item["spec"].get("sharedCounters"))
        assert len(item["spec"].get("devices") or []) <= MAX_DEVICES_WITH_TAINTS


def _server_without_partitions() -> Any:
    assets = kubebuilder_assets()
    if assets:
        return RealApiServer(assets, partitionable_devices=False)
    return ApiServerStandIn(partitionable_devices=False)


def test_a_server_that_drops_counters_gets_todays_model_told_once(run, tmp_path, caplog):
    load_machine("hgx-h100-mig", tmp_path)
    devices = _devices(str(tmp_path), NVIDIA_DRA)
    other = [d for d in devices if d.attributes.get("parent") == GPU1] + \
        [d for d in devices if d.id == GPU1]
    assert len(other) == 3  # a second pool with a partitioned GPU: still one warning
    driver = driver_name(NVIDIA_DRA.name, None, "gpu")
    with _server_without_partitions() as api, \
            caplog.at_level(logging.WARNING, logger="host.dra.publisher"):
        api.add_node(NODE)
        run(_publish(api, {NVIDIA_DRA.name: devices, "example.com/other": other}, driver))
        stored = api.resource_slices(driver, NODE)
    assert not _counter_sets(stored)
    names = _by_name(stored)
    assert not any("consumesCounters" in d for d in names.values())
    assert dra_device_name(GPU0) not in names and dra_device_name(GPU1) not in names
    assert dra_device_name(f"{GPU0}-gi7-ci0") in names
    told = [r for r in caplog.records if "dropped shared counters" in r.getMessage()]
    assert len(told) == 1


@pytest.mark.parametrize("machine,parents,per_parent", [("hgx-h100-mig", 2, {7, 2}),
                                                         ("mi300x-cpx-nps4", 8, {8})])
def test_discover_json_shows_the_counters_and_who_consumes_them(tmp_path, machine, parents,
                                                                  per_parent):
    """What docs/dra-partitions.md shows: ``discover --json`` with the dra overlay's config."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    load_machine(machine, tmp_path)
    result = subprocess.run(
        [sys.executable, "-m", "host", "discover", "--json", "--config",
         str(repo / "deploy/kubernetes/overlays/dra/config.toml"), "--host-root", str(tmp_path)],
        capture_output=True, text=True, timeout=120, cwd=repo, check=False,
        env={**os.environ, "NODE_NAME": NODE})
    assert result.returncode == 0, result.stderr
    rows = [r["dra"] for r in json.loads(result.stdout)]
    owners = {r["device_name"]: r["shared_counters"] for r in rows if "shared_counters" in r}
    assert len(owners) == parents
    assert {int(s["counters"]["partitions"]["value"]) for s in owners.values()} == per_parent
    for row in rows:
        kind = row["attributes"]["type"]["string"]
        consumes = row.get("consumes_counters")
        if row["device_name"] in owners:  # the partitioned GPU consumes all of its set
            assert row["attributes"]["partitioned"] == {"bool": True}
            assert consumes == [{"counterSet": row["device_name"],
                                 "counters": owners[row["device_name"]]["counters"]}]
        elif kind in ("mig", "partition"):
            assert consumes and consumes[0]["counterSet"] in owners
            assert consumes[0]["counters"] == {"partitions": {"value": "1"}}
        else:
            assert kind == "gpu" and consumes is None
