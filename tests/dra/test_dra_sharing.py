"""Devices shared by several claims (``replicas = N`` with ``api = "dra"``): consumable capacity
in the slices, its fallback where the server drops it, and NodePrepareResources handing each
claim its own share (share_id, a CDI entry of its own) and refusing what does not fit.

The API server is the stand-in, or the real one with KUBEBUILDER_ASSETS (``kube_api``); the
kubelet is the DRA simulator over real sockets; containers are what
testkit/device_plugin_host_testing/cdi_runtime injects. The real scheduler allocating shares is in
test_dra_real_scheduler.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import uuid
from typing import Any, Dict, List, Optional

import pytest

from device_plugin_host_testing.cdi_runtime import CdiCache, container_cdi_ids
from device_plugin_host_testing.drivers import MemoryDriver
from host.config.errors import ConfigError
from host.core.hostfs import HostFS
from host.core.isolation import DriverCalls
from host.core.model import Device, DeviceNode, Health, ResourceConfig
from host.dra import hardware, naming, sharing
from host.dra.frontend import DraFrontEnd
from host.dra.kube import KubeClient
from host.dra.publisher import SlicePublisher
from host.dra.slices import build_slices
from host.inventory.host_view import host_view
from host.sim.apiserver import (
    ApiServerStandIn,
    RealApiServer,
    kube_api,
    kubebuilder_assets,
)
from host.sim.kubelet_dra import DraKubeletSimulator, PrepareError
from host.sim.resource_validation import resource_slice_errors

__all__ = ["kube_api"]

NODE = "node-1"
SHARES = 2
RESOURCE = ResourceConfig(name="nvidia.com/gpu", driver="memory", api="dra", replicas=SHARES)
DRIVER = naming.driver_name(RESOURCE.name, None)
POOL = naming.pool_name(RESOURCE.name, NODE)


def gpu(i: int) -> Device:
    address = f"0000:{0x10 + i:02x}:00.0"
    return Device(id=address, device_nodes=(DeviceNode(f"/dev/nvidia{i}"),),
                  env={"NVIDIA_VISIBLE_DEVICES": f"GPU-{i}"},
                  attributes={"pci_address": address, "vendor": "0x10de",
                              "memory_bytes": str(80 << 30)})


def replicas(devices: List[Device], resource: ResourceConfig = RESOURCE) -> List[Device]:
    """What the inventory hands the front end (host_view expands replicas)."""
    return host_view(resource, devices, excluded=None, aer={}, drains={})


def name(i: int) -> str:
    return naming.dra_device_name(gpu(i).id)


# -- slices ------------------------------------------------------------------------------------


def test_a_shared_device_is_published_once_with_a_shares_capacity():
    [piece] = build_slices(DRIVER, NODE, POOL, replicas([gpu(0), gpu(1)]), 1, shares=SHARES)
    devices = {d["name"]: d for d in piece["spec"]["devices"]}
    assert sorted(devices) == sorted([name(0), name(1)])
    entry = devices[name(0)]
    assert entry["allowMultipleAllocations"] is True
    assert entry["capacity"]["shares"] == {"value": "2", "requestPolicy": {
        "default": "1", "validRange": {"min": "1", "max": "2", "step": "1"}}}
    # memory stays a capacity, one a claim may ask for and that nothing else consumes
    assert entry["capacity"]["memory"] == {"value": "80Gi", "requestPolicy": {
        "default": "0", "validRange": {"min": "0"}}}
    assert "replica_of" not in str(entry["attributes"])
    assert resource_slice_errors(piece) == []


def test_without_consumable_capacity_each_replica_is_a_device_of_its_own():
    [piece] = build_slices(DRIVER, NODE, POOL, replicas([gpu(0)]), 1, shares=SHARES,
                           consumable=False)
    names = sorted(d["name"] for d in piece["spec"]["devices"])
    assert names == sorted(naming.dra_device_name(f"{gpu(0).id}::{k}") for k in range(SHARES))
    assert not any("allowMultipleAllocations" in d or "requestPolicy" in str(d)
                   for d in piece["spec"]["devices"])
    assert resource_slice_errors(piece) == []


def test_a_shared_device_is_unhealthy_while_any_replica_is():
    devices = replicas([gpu(0)])
    devices[1] = devices[1].with_health(Health.UNHEALTHY, "drained by an operator: burn-in")
    [base] = sharing.bases(devices)
    assert base.id == gpu(0).id and not base.healthy
    assert base.health_reason == "drained by an operator: burn-in"
    [piece] = build_slices(DRIVER, NODE, POOL, devices, 1, shares=SHARES)
    assert piece["spec"]["devices"] == []  # left out, as any unhealthy device


@pytest.mark.parametrize("policy,field", [
    ({"default": "3", "validRange": {"min": "1", "max": "2"}}, "validRange.max"),
    ({"validRange": {"min": "1"}}, "requestPolicy.default"),
    ({"default": "1", "validValues": ["2", "1"]}, "validValues"),
    ({"default": "1", "validValues": ["1"], "validRange": {"min": "1"}}, "requestPolicy"),
])
def test_the_stand_in_refuses_request_policies_the_real_server_refuses(policy, field):
    [piece] = build_slices(DRIVER, NODE, POOL, replicas([gpu(0)]), 1, shares=SHARES)
    piece["spec"]["devices"][0]["capacity"]["shares"]["requestPolicy"] = policy
    errors = resource_slice_errors(piece)
    assert errors and field in errors[0].field, errors


def test_a_share_overlaps_the_whole_device_and_its_partitions_not_other_shares():
    whole = ("pci:0000:10:00.0",)
    share = hardware.shared(whole)
    assert hardware.conflict(share, hardware.shared(whole)) is None
    assert "the same PCI function 0000:10:00.0" in hardware.conflict(share, whole)
    assert "partition mig:1/0" in hardware.conflict(share, ("pci:0000:10:00.0#mig:1/0",))
    replica = hardware.footprint(replicas([gpu(0)])[0], {})
    assert hardware.conflict(replica, share) is None
    assert hardware.conflict(replica, whole)
    assert hardware.conflict(replica, replica) == f"the same replica {gpu(0).id}::0"


def test_replicas_with_api_dra_are_accepted_and_replica_policy_is_not():
    from device_plugin_host_testing.drivers import MemoryDriver as Memory
    from host.config import parse_config

    drivers = {"memory": Memory()}
    text = '[[resource]]\nname = "example.com/gpu"\ndriver = "memory"\napi = "dra"\n' \
        'replicas = 4\n'
    [resource] = parse_config(text, "f.toml", drivers).resources
    assert resource.replicas == 4 and resource.api == "dra"
    with pytest.raises(ConfigError, match="replica_policy"):
        parse_config(text + 'replica_policy = "spread"\n', "f.toml", drivers)


# -- publishing --------------------------------------------------------------------------------


async def _publish(api: Any, devices: List[Device]) -> List[Dict[str, Any]]:
    client = KubeClient.from_settings(api.kubeconfig_path, timeout_s=2)
    publisher = SlicePublisher(client, NODE)
    publisher.set_pool(DRIVER, POOL, devices, SHARES)
    await publisher.start()
    try:
        assert await publisher.wait_synced()
        return api.resource_slices(DRIVER, NODE)  # type: ignore[no-any-return]
    finally:
        await publisher.stop()
        await client.close()


def test_the_server_keeps_the_shareable_device(kube_api, run):
    kube_api.add_node(NODE)
    [stored] = run(_publish(kube_api, replicas([gpu(0), gpu(1)])))
    devices = {d["name"]: d for d in stored["spec"]["devices"]}
    assert sorted(devices) == sorted([name(0), name(1)])
    assert devices[name(0)]["allowMultipleAllocations"] is True
    assert devices[name(0)]["capacity"]["shares"]["requestPolicy"]["validRange"]["max"] == "2"


def _server_without_consumable_capacity() -> Any:
    assets = kubebuilder_assets()
    if assets:
        return RealApiServer(assets, consumable_capacity=False)
    return ApiServerStandIn(consumable_capacity=False)


def test_a_server_that_drops_the_fields_gets_one_device_per_replica_told_once(run, caplog):
    with _server_without_consumable_capacity() as api, \
            caplog.at_level(logging.WARNING, logger="host.dra.publisher"):
        api.add_node(NODE)
        [stored] = run(_publish(api, replicas([gpu(0), gpu(1)])))
    names = sorted(d["name"] for d in stored["spec"]["devices"])
    assert names == sorted(naming.dra_device_name(f"{gpu(i).id}::{k}")
                           for i in range(2) for k in range(SHARES))
    assert not any(d.get("allowMultipleAllocations") for d in stored["spec"]["devices"])
    told = [r for r in caplog.records if "dropped allowMultipleAllocations" in r.getMessage()]
    assert len(told) == 1


# -- prepare -----------------------------------------------------------------------------------


class Node:
    def __init__(self, root: str, api: Any, devices: List[Device]) -> None:
        self.root, self.api = root, api
        self.driver = MemoryDriver(devices={RESOURCE.name: devices})
        self.registry = os.path.join(root, "registry")
        self.plugins = os.path.join(root, "plugins")
        self.cdi = os.path.join(root, "cdi")
        self.state = os.path.join(root, "state")
        self.front: Optional[DraFrontEnd] = None
        self.kubelet: Optional[DraKubeletSimulator] = None

    async def start_host(self) -> None:
        self.calls = DriverCalls()
        self.client = KubeClient.from_settings(self.api.kubeconfig_path)
        self.front = DraFrontEnd(node_name=NODE, claims=self.client, calls=self.calls,
                                 registry_dir=self.registry, plugins_dir=self.plugins,
                                 state_dir=self.state, cdi_dir=self.cdi, allocate_timeout_s=2,
                                 host=HostFS(os.path.join(self.root, "hostroot")))
        self.front.sync(RESOURCE, self.driver,
                        replicas(list(self.driver.devices[RESOURCE.name])))

    async def stop_host(self) -> None:
        assert self.front is not None
        await self.front.close()
        await self.client.close()
        self.calls.shutdown()

    def claim(self, claim: str, pod: str, shares: Dict[str, int]) -> Dict[str, Any]:
        """A claim allocated a share (``shareID``, ``consumedCapacity``) of each device."""
        results = [{"request": "gpu", "driver": DRIVER, "pool": POOL, "device": device,
                    "shareID": str(uuid.uuid4()),
                    "consumedCapacity": {"shares": str(count)}}
                   for device, count in shares.items()]
        return self.api.put_resource_claim({  # type: ignore[no-any-return]
            "metadata": {"name": claim, "namespace": "default"},
            "spec": {"devices": {"requests": [
                {"name": "gpu", "exactly": {"deviceClassName": "gpu", "count": len(shares)}}]}},
            "status": {"allocation": {"devices": {"results": results}},
                       "reservedFor": [{"resource": "pods", "name": "p", "uid": pod}]}})

    def whole(self, claim: str, pod: str, device: str) -> Dict[str, Any]:
        return self.api.put_resource_claim({  # type: ignore[no-any-return]
            "metadata": {"name": claim, "namespace": "default"},
            "spec": {"devices": {"requests": [
                {"name": "gpu", "exactly": {"deviceClassName": "gpu"}}]}},
            "status": {"allocation": {"devices": {"results": [
                {"request": "gpu", "driver": DRIVER, "pool": POOL, "device": device}]}},
                "reservedFor": [{"resource": "pods", "name": "p", "uid": pod}]}})

    def container(self, claim: str, info: Any) -> Dict[str, str]:
        cache = CdiCache(self.cdi)
        assert cache.errors == {}
        return cache.inject(container_cdi_ids([(claim, info)], [(claim, "")])).environ()


@contextlib.asynccontextmanager
async def node(root: str, api: Any, devices: List[Device]):
    api.add_node(NODE)
    n = Node(root, api, devices)
    await n.start_host()
    n.kubelet = DraKubeletSimulator(n.registry, node_name=NODE,
                                    get_claim=lambda ns, c: n.client.get_resource_claim(ns, c),
                                    plugins_dir=n.plugins)
    await n.kubelet.start()
    try:
        await n.kubelet.wait_registered(DRIVER)
        yield n
    finally:
        await n.kubelet.stop()
        await n.stop_host()


def test_two_claims_share_one_device_each_with_its_own_share(short_dir, run, kube_api):
    async def body():
        async with node(short_dir, kube_api, [gpu(0)]) as n:
            pods = [str(uuid.uuid4()) for _ in range(3)]
            claims = [n.claim(f"c{i}", pods[i], {name(0): 1}) for i in range(2)]
            infos = [(await n.kubelet.prepare(pods[i], [("default", f"c{i}")]))[0]
                     for i in range(2)]
            for claim, info in zip(claims, infos):
                [device] = info.devices[DRIVER]
                want = claim["status"]["allocation"]["devices"]["results"][0]["shareID"]
                assert device.share_id == want and device.device_name == name(0)
            ids = [set(info.cdi_devices()) for info in infos]
            assert not ids[0] & ids[1]  # no CDI entry is shared between the two claims
            for i, info in enumerate(infos):
                env = n.container(f"c{i}", info)
                assert env[sharing.ENV_SHARE_ID] == infos[i].devices[DRIVER][0].share_id
                assert env[sharing.ENV_SHARES] == "1" and env[sharing.ENV_SHARES_TOTAL] == "2"
                assert env[sharing.ENV_MPS_PERCENT] == "50"
                assert env["NVIDIA_VISIBLE_DEVICES"] == "GPU-0"
            # the capacity is spent: a third share is refused, and so is the whole device
            n.claim("c2", pods[2], {name(0): 1})
            with pytest.raises(PrepareError, match="shared 2 ways and 2 shares are held"):
                await n.kubelet.prepare(pods[2], [("default", "c2")])
            n.whole("w", pods[2], name(0))
            with pytest.raises(PrepareError, match="a share of a device used whole"):
                await n.kubelet.prepare(pods[2], [("default", "w")])
            await n.kubelet.unprepare(pods[2])
            # one share given back makes room for one more
            await n.kubelet.unprepare(pods[0])
            [again] = await n.kubelet.prepare(pods[2], [("default", "c2")])
            assert again.devices[DRIVER][0].share_id

    run(body())


def test_shares_survive_a_host_restart(short_dir, run, kube_api):
    async def body():
        async with node(short_dir, kube_api, [gpu(0)]) as n:
            pods = [str(uuid.uuid4()) for _ in range(3)]
            n.claim("two", pods[0], {name(0): 2})  # both shares in one claim
            [info] = await n.kubelet.prepare(pods[0], [("default", "two")])
            share_id = info.devices[DRIVER][0].share_id
            assert n.container("two", info)[sharing.ENV_SHARES] == "2"
            from host.dra.claims_view import claim_rows

            [row] = claim_rows(n.state)  # what `device-plugin-host pods --claims --json` shows
            assert (row["share_id"], row["shares"]) == (share_id, 2)
            await n.stop_host()
            await n.start_host()  # a new process: only the checkpoint knows the shares
            await n.kubelet.restart(wipe_sockets=True)
            await n.kubelet.wait_registered(DRIVER)
            [again] = await n.kubelet.prepare(pods[0], [("default", "two")])
            assert again.devices[DRIVER][0].share_id == share_id
            n.claim("one", pods[1], {name(0): 1})
            with pytest.raises(PrepareError, match="2 shares are held"):
                await n.kubelet.prepare(pods[1], [("default", "one")])

    run(body())


def test_a_share_of_a_device_that_is_not_shared_is_refused(short_dir, run, kube_api):
    async def body():
        async with node(short_dir, kube_api, [gpu(0)]) as n:
            pod = str(uuid.uuid4())
            replica = naming.dra_device_name(f"{gpu(0).id}::0")
            n.claim("odd", pod, {replica: 1})
            with pytest.raises(PrepareError, match="not shared on this node"):
                await n.kubelet.prepare(pod, [("default", "odd")])

    run(body())


def test_replicas_published_without_the_gate_are_prepared_as_shares(short_dir, run, kube_api):
    """A claim allocated a replica (the fallback's devices) gets it whole; replicas of one
    device coexist; the same replica twice does not."""
    async def body():
        async with node(short_dir, kube_api, [gpu(0)]) as n:
            pods = [str(uuid.uuid4()) for _ in range(3)]
            for k in range(SHARES):
                n.whole(f"r{k}", pods[k], naming.dra_device_name(f"{gpu(0).id}::{k}"))
                [info] = await n.kubelet.prepare(pods[k], [("default", f"r{k}")])
                env = n.container(f"r{k}", info)
                assert env[sharing.ENV_SHARES] == "1" and sharing.ENV_SHARE_ID not in env
            n.whole("again", pods[2], naming.dra_device_name(f"{gpu(0).id}::0"))
            with pytest.raises(PrepareError, match="the same replica"):
                await n.kubelet.prepare(pods[2], [("default", "again")])

    run(body())


def test_two_claims_racing_for_the_last_share_get_one_prepared(short_dir, run, kube_api):
    """The count holds for claims being prepared at the same moment (one gRPC call each,
    concurrently), not only for those already checkpointed."""
    async def body():
        async with node(short_dir, kube_api, [gpu(0)]) as n:
            pods = [str(uuid.uuid4()) for _ in range(3)]
            n.claim("first", pods[0], {name(0): 1})
            await n.kubelet.prepare(pods[0], [("default", "first")])
            uids = [n.claim(f"race{i}", pods[i + 1], {name(0): 1})["metadata"]["uid"]
                    for i in range(2)]
            answers = await asyncio.gather(*(
                n.kubelet.node_prepare(DRIVER, [("default", f"race{i}", uids[i])])
                for i in range(2)))
            errors = [a.claims[u].error for a, u in zip(answers, uids)]
            assert sorted(bool(e) for e in errors) == [False, True], errors
            assert "shares are held" in next(e for e in errors if e)

    run(body())
