"""The slice publisher against the API server (stand-in; real with KUBEBUILDER_ASSETS):
attributes read back, 300 devices in 3 slices, hot-plug, health, outages, 422 and 409."""

from __future__ import annotations

import asyncio
import dataclasses
import logging

import pytest

from host.dra.kube import KubeClient
from host.dra.naming import dra_device_name, driver_name, pool_name
from host.dra.publisher import SlicePublisher
from host.metrics import HostMetrics
from host.model import Device, Health
from host.testing.apiserver import ApiServerStandIn, kube_api

__all__ = ["kube_api"]

NODE = "node-a"
RESOURCE = "nvidia.com/gpu"
DRIVER = driver_name(RESOURCE, None)
POOL = pool_name(RESOURCE, NODE)


def gpu(i: int, healthy: bool = True, numa: int = 0) -> Device:
    address = f"0000:{0x10 + i // 32:02x}:{i % 32:02x}.0"
    return Device(
        id=address, numa_nodes=(numa,),
        health=Health.HEALTHY if healthy else Health.UNHEALTHY,
        health_reason="" if healthy else "XID 79: GPU has fallen off the bus",
        attributes={"pci_address": address, "vendor": "0x10de", "device": "0x20b0",
                    "kernel_driver": "nvidia", "model": "NVIDIA A100-SXM4-40GB",
                    "device_minor": str(i), "pcie_root": "pci0000:00",
                    "memory_bytes": str(40 << 30)})


async def publishing(api, devices, body, **kwargs):
    client = KubeClient.from_settings(api.kubeconfig_path, timeout_s=2)
    publisher = SlicePublisher(client, NODE, **kwargs)
    publisher.set_pool(DRIVER, POOL, devices)
    await publisher.start()
    try:
        return await body(publisher)
    finally:
        await publisher.stop()
        await client.close()


def test_slices_with_the_right_attributes_read_back(kube_api, run):
    node = kube_api.add_node(NODE)

    async def body(publisher):
        assert await publisher.wait_synced()

    run(publishing(kube_api, [gpu(0, numa=1), gpu(1)], body))
    slices = kube_api.resource_slices(DRIVER, NODE)
    assert len(slices) == 1
    spec = slices[0]["spec"]
    assert spec["pool"] == {"name": POOL, "generation": 1, "resourceSliceCount": 1}
    assert slices[0]["metadata"]["ownerReferences"][0]["uid"] == node["metadata"]["uid"]
    assert slices[0]["metadata"]["ownerReferences"][0]["kind"] == "Node"
    device = {d["name"]: d for d in spec["devices"]}[dra_device_name(gpu(0).id)]
    attributes = device["attributes"]
    assert attributes["resource.kubernetes.io/pcieRoot"] == {"string": "pci0000:00"}
    assert attributes["resource.kubernetes.io/pciBusID"] == {"string": "0000:10:00.0"}
    assert attributes["resource.kubernetes.io/numaNode"] == {"int": 1}
    assert attributes["vendor"] == {"string": "0x10de"}
    assert attributes["model"] == {"string": "NVIDIA A100-SXM4-40GB"}
    assert attributes["device_minor"] == {"int": 0}
    assert device["capacity"] == {"memory": {"value": "40Gi"}}


def test_300_devices_in_3_slices(kube_api, run):
    kube_api.add_node(NODE)

    async def body(publisher):
        assert await publisher.wait_synced()

    run(publishing(kube_api, [gpu(i) for i in range(300)], body))
    slices = kube_api.resource_slices(DRIVER, NODE)
    assert sorted(len(s["spec"]["devices"]) for s in slices) == [44, 128, 128]
    assert {s["spec"]["pool"]["resourceSliceCount"] for s in slices} == {3}
    assert len(kube_api.devices(DRIVER, NODE)) == 300


def test_hot_plug_and_health_update_the_slice(kube_api, run):
    kube_api.add_node(NODE)
    devices = [gpu(0), gpu(1)]

    async def body(publisher):
        assert await publisher.wait_synced()
        publisher.set_pool(DRIVER, POOL, [*devices, gpu(2)])  # hot-plug
        assert await publisher.wait_synced()
        hot = kube_api.devices(DRIVER, NODE)
        publisher.set_pool(DRIVER, POOL, [gpu(0), gpu(1, healthy=False), gpu(2)])
        assert await publisher.wait_synced()
        sick = kube_api.devices(DRIVER, NODE)
        publisher.set_pool(DRIVER, POOL, [gpu(0), gpu(1), gpu(2)])
        assert await publisher.wait_synced()
        return hot, sick, kube_api.devices(DRIVER, NODE)

    hot, sick, healed = run(publishing(kube_api, devices, body))
    names = [dra_device_name(gpu(i).id) for i in range(3)]
    assert sorted(hot) == sorted(names)
    assert sorted(sick) == sorted([names[0], names[2]])  # unhealthy: left out
    assert sorted(healed) == sorted(names)
    assert kube_api.resource_slices(DRIVER, NODE)[0]["spec"]["pool"]["generation"] == 4


def test_health_becomes_a_taint_where_the_server_keeps_taints(run):
    with ApiServerStandIn(device_taints=True) as api:
        api.add_node(NODE)

        async def body(publisher):
            assert await publisher.wait_synced()

        run(publishing(api, [gpu(0), gpu(1, healthy=False)], body, taint_unhealthy=True))
        sick = api.devices(DRIVER, NODE)[dra_device_name(gpu(1).id)]
        assert sick["taints"] == [{"key": "device-plugin-host.io/unhealthy",
                                   "value": "XID-79-GPU-has-fallen-off-the-bus",
                                   "effect": "NoSchedule"}]


def test_taints_dropped_by_the_server_fall_back_to_leaving_out(run):
    with ApiServerStandIn(device_taints=False) as api:  # 1.34/1.35 defaults
        api.add_node(NODE)

        async def body(publisher):
            assert await publisher.wait_synced()

        run(publishing(api, [gpu(0), gpu(1, healthy=False)], body, taint_unhealthy=True))
        assert sorted(api.devices(DRIVER, NODE)) == [dra_device_name(gpu(0).id)]


def test_api_server_down_during_a_change_then_back(run, caplog):
    with ApiServerStandIn() as api, caplog.at_level(logging.INFO, logger="host.dra.publisher"):
        api.add_node(NODE)

        async def body(publisher):
            assert await publisher.wait_synced()
            api.stop()
            publisher.set_pool(DRIVER, POOL, [gpu(0), gpu(1)])  # never blocks, never raises
            deadline = asyncio.get_running_loop().time() + 10
            while publisher.failures < 3:  # a few retries with backoff while it is away
                assert asyncio.get_running_loop().time() < deadline
                await asyncio.sleep(0.01)
            assert publisher.last_error is not None and publisher.last_error.status == 0
            assert not await publisher.wait_synced(0.05)
            api.start()
            assert await publisher.wait_synced(10)

        run(publishing(api, [gpu(0)], body))
        assert len(api.devices(DRIVER, NODE)) == 2
    lines = [r.getMessage() for r in caplog.records]
    assert len([m for m in lines if "cannot publish" in m]) == 1  # once, not once a retry
    assert len([m for m in lines if "published again" in m]) == 1


def test_a_rejected_slice_is_logged_once_and_counted(run, caplog):
    with ApiServerStandIn() as api:
        api.add_node(NODE)
        metrics = HostMetrics()

        async def scenario():
            client = KubeClient.from_settings(api.kubeconfig_path)
            publisher = SlicePublisher(client, NODE, metrics=metrics)
            bad_pool = "node-a/Not_A_Subdomain"  # fails upstream validatePoolName
            await publisher.start()
            try:
                publisher.set_pool(DRIVER, bad_pool, [gpu(0)])
                assert await publisher.wait_synced()
                publisher.set_pool(DRIVER, bad_pool, [gpu(0), gpu(1)])
                assert await publisher.wait_synced()
                publisher.set_pool(DRIVER, POOL, [gpu(0)])  # other pools keep working
                assert await publisher.wait_synced()
            finally:
                await publisher.stop()
                await client.close()

        with caplog.at_level(logging.ERROR, logger="host.dra.publisher"):
            run(scenario())
        rejections = [r for r in caplog.records if "rejected" in r.getMessage()]
        assert len(rejections) == 1
        assert "spec.pool.name" in rejections[0].getMessage()
        assert metrics.registry.get_sample_value(
            "device_plugin_host_dra_slice_rejections_total",
            {"driver": DRIVER, "pool": "node-a/Not_A_Subdomain"}) == 2
        assert len(api.devices(DRIVER, NODE)) == 1


def test_conflict_rereads_and_retries(run):
    with ApiServerStandIn() as api:
        api.add_node(NODE)

        async def body(publisher):
            assert await publisher.wait_synced()
            # Another writer touches our slice: our cached resourceVersion goes stale.
            stored = api.resource_slices(DRIVER, NODE)[0]
            stored["metadata"]["labels"] = {"touched": "yes"}
            api.put_resource_slice(stored)
            api.reset_counters()
            publisher.set_pool(DRIVER, POOL, [gpu(0), gpu(1)])
            assert await publisher.wait_synced()

        run(publishing(api, [gpu(0)], body))
        assert len(api.devices(DRIVER, NODE)) == 2
        # update -> 409, list (re-read), update again.
        assert [(m, code) for m, _p, code in api.request_log] == [
            ("PUT", 409), ("GET", 200), ("PUT", 200)]


def test_injected_conflicts_and_server_errors_are_retried(run):
    with ApiServerStandIn() as api:
        api.add_node(NODE)

        async def body(publisher):
            assert await publisher.wait_synced()
            api.fail_next(409, count=2, verbs={"update"})
            api.fail_next(503, count=2, verbs={"list"})
            publisher.set_pool(DRIVER, POOL, [gpu(0), gpu(1)])
            assert await publisher.wait_synced()

        run(publishing(api, [gpu(0)], body))
        assert len(api.devices(DRIVER, NODE)) == 2


def test_a_burst_of_events_is_coalesced(run):
    with ApiServerStandIn(latency_s=0.01) as api:
        api.add_node(NODE)

        async def body(publisher):
            assert await publisher.wait_synced()
            api.reset_counters()
            for n in range(1, 51):
                publisher.set_pool(DRIVER, POOL, [gpu(i) for i in range(n)])
                await asyncio.sleep(0)
            assert await publisher.wait_synced()

        run(publishing(api, [gpu(0)], body))
        assert len(api.devices(DRIVER, NODE)) == 50
        assert api.requests["update"] <= 3  # one in flight, then the newest state


def test_kubelet_restart_deletes_slices_and_republish_restores_them(run):
    with ApiServerStandIn() as api:
        api.add_node(NODE)

        async def body(publisher):
            assert await publisher.wait_synced()
            assert api.delete_slices_of_node(NODE) == 1
            publisher.republish()
            assert await publisher.wait_synced()

        run(publishing(api, [gpu(0)], body))
        assert len(api.devices(DRIVER, NODE)) == 1


def test_remove_pool_and_stop_with_delete(run):
    with ApiServerStandIn() as api:
        api.add_node(NODE)

        async def scenario():
            client = KubeClient.from_settings(api.kubeconfig_path)
            publisher = SlicePublisher(client, NODE)
            publisher.set_pool(DRIVER, POOL, [gpu(0)])
            publisher.set_pool("other.device-plugin-host.io", POOL, [gpu(1)])
            await publisher.start()
            try:
                assert await publisher.wait_synced()
                assert len(api.resource_slices(node=NODE)) == 2
                publisher.remove_pool(DRIVER, POOL)
                assert await publisher.wait_synced()
                assert [s["spec"]["driver"] for s in api.resource_slices(node=NODE)] == [
                    "other.device-plugin-host.io"]
            finally:
                await publisher.stop(delete=True)
                await client.close()

        run(scenario())
        assert api.resource_slices(node=NODE) == []


def test_an_empty_pool_is_one_empty_slice(kube_api, run):
    kube_api.add_node(NODE)

    async def body(publisher):
        assert await publisher.wait_synced()

    run(publishing(kube_api, [], body))
    slices = kube_api.resource_slices(DRIVER, NODE)
    assert len(slices) == 1 and not slices[0]["spec"].get("devices")


@pytest.mark.parametrize("count", [1, 128, 129])
def test_one_request_per_changed_slice(run, count):
    with ApiServerStandIn() as api:
        api.add_node(NODE)

        async def body(publisher):
            assert await publisher.wait_synced()
            api.reset_counters()
            publisher.set_pool(DRIVER, POOL, [gpu(i, healthy=i != 0) for i in range(count)])
            assert await publisher.wait_synced()
            unchanged = dict(api.requests)
            publisher.set_pool(DRIVER, POOL, [gpu(i, healthy=i != 0) for i in range(count)])
            assert await publisher.wait_synced()
            return unchanged

        first = run(publishing(api, [gpu(i) for i in range(count)], body))
        slices_before = -(-count // 128)
        assert sum(first.values()) == slices_before  # one PUT per slice, no list, no get
        assert sum(api.requests.values()) == sum(first.values())  # no change: no request


def test_too_many_requests_waits_the_servers_retry_after(run):
    with ApiServerStandIn() as api:
        api.add_node(NODE)

        async def body(publisher):
            assert await publisher.wait_synced()
            api.fail_next(429, count=1, verbs={"update"})
            loop = asyncio.get_running_loop()
            start = loop.time()
            publisher.set_pool(DRIVER, POOL, [gpu(0), gpu(1)])
            assert await publisher.wait_synced()
            return loop.time() - start

        took = run(publishing(api, [gpu(0)], body))
        assert took >= 1.0  # Retry-After: 1, not the 0.05 s first backoff
        assert publisher_error_kinds(api) == [("PUT", 429), ("PUT", 200)]


def publisher_error_kinds(api):
    return [(m, code) for m, _p, code in api.request_log if m != "GET"][-2:]


def test_slices_deleted_by_the_kubelet_after_our_republish_come_back(run):
    # The kubelet's start-up wipe runs in the background with retries (Node GET first, backoff
    # from 1 s: DRAPluginManager.wipeResourceSlices), so it can land after our registration
    # already republished: nothing else would make us publish again until a device changes.
    with ApiServerStandIn() as api:
        api.add_node(NODE)

        async def body(publisher):
            assert await publisher.wait_synced()
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 5
            while api.watches == 0 and loop.time() < deadline:
                await asyncio.sleep(0.01)
            assert api.delete_slices_of_node(NODE) == 1
            ok = await loop.run_in_executor(
                None, lambda: api.wait_for(lambda a: len(a.devices(DRIVER, NODE)) == 2, 5))
            return ok

        assert run(publishing(api, [gpu(0), gpu(1)], body))


def test_our_own_deletes_cost_no_extra_requests_and_a_broken_watch_resumes(run):
    with ApiServerStandIn() as api:
        api.add_node(NODE)

        async def body(publisher):
            assert await publisher.wait_synced()
            api.reset_counters()
            publisher.set_pool(DRIVER, POOL, [gpu(i) for i in range(10)])  # 130 -> 1 slice
            assert await publisher.wait_synced()
            await asyncio.sleep(0.2)  # the DELETED event of our own delete has arrived
            assert publisher.republished_after_delete == 0
            assert [m for m, _p, _c in api.request_log] == ["PUT", "DELETE"]
            # An outage cuts the watch; a wipe while we are away is seen after it resumes.
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, api.stop)
            api.delete_slices_of_node(NODE)
            await loop.run_in_executor(None, api.start)
            ok = await loop.run_in_executor(
                None, lambda: api.wait_for(lambda a: len(a.devices(DRIVER, NODE)) == 10, 10))
            return ok

        assert run(publishing(api, [gpu(i) for i in range(130)], body))


def test_an_expired_watch_reads_every_pool_again(run):
    with ApiServerStandIn() as api:
        api.add_node(NODE)

        async def body(publisher):
            assert await publisher.wait_synced()
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, api.stop)
            api.delete_slices_of_node(NODE)
            api.compact()  # the deletion's event is gone from the watch cache: 410 on resume
            await loop.run_in_executor(None, api.start)
            return await loop.run_in_executor(
                # Beyond BACKOFF_MAX_S: a loaded machine can stretch the outage over several
                # retries of the watch, and each waits longer (a deadline, not a sleep).
                None, lambda: api.wait_for(lambda a: len(a.devices(DRIVER, NODE)) == 1, 40))

        assert run(publishing(api, [gpu(0)], body), timeout=60)


def test_a_watch_that_breaks_before_any_event_reads_every_pool_again(run):
    """A watch that never delivered a resourceVersion has nothing to resume from: the next one
    starts from "now", so a deletion in between would go unseen (it did, about one run in
    twenty of the test above on Python 3.9: the apiserver stopped while our own slice's
    ADDED event was still in flight). Here every watch fails for a while, and our slice is
    deleted meanwhile: only reading our pools again brings it back."""
    with ApiServerStandIn() as api:
        api.add_node(NODE)
        api.fail_next(503, count=5, verbs={"watch"})  # ~1.5 s of backoff: 0.05 s doubling

        async def body(publisher):
            assert await publisher.wait_synced()
            assert api.watches < 5, "the watch got through before the deletion"
            api.delete_slices_of_node(NODE)
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(
                None, lambda: api.wait_for(lambda a: len(a.devices(DRIVER, NODE)) == 1, 20))

        assert run(publishing(api, [gpu(0)], body), timeout=40)


def test_a_decimal_memory_size_is_written_as_the_server_stores_it(run):
    # resource.Quantity decodes "5000000000" and stores "5G": a capacity written in another
    # form never compares equal to what we read back, and every rescan would rewrite the pool
    # with a new generation.
    decimal = dataclasses.replace(gpu(0), attributes=dict(gpu(0).attributes,
                                                          memory_bytes=str(5 * 10 ** 9)))
    with ApiServerStandIn() as api:
        api.add_node(NODE)

        async def body(publisher):
            assert await publisher.wait_synced()
            api.reset_counters()
            publisher.set_pool(DRIVER, POOL, [decimal])
            assert await publisher.wait_synced()

        run(publishing(api, [decimal], body))
        assert sum(api.requests.values()) == 0
        [device] = api.devices(DRIVER, NODE).values()
        assert device["capacity"] == {"memory": {"value": "5G"}}


def test_slices_collected_with_a_replaced_node_come_back_owned_by_the_new_one(run):
    # A Node deleted and registered again gets a new UID; the garbage collector deletes the
    # slices owned by the old one. Republished with the cached old UID they would be
    # collected again, forever.
    with ApiServerStandIn() as api:
        old = api.add_node(NODE)

        async def body(publisher):
            assert await publisher.wait_synced()
            api.delete_node(NODE)
            new = api.add_node(NODE)
            assert new["metadata"]["uid"] != old["metadata"]["uid"]
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 5
            while api.watches == 0 and loop.time() < deadline:
                await asyncio.sleep(0.01)
            api.delete_slices_of_node(NODE)  # what the garbage collector does
            ok = await loop.run_in_executor(
                None, lambda: api.wait_for(lambda a: len(a.resource_slices(DRIVER, NODE)), 5))
            return ok, new["metadata"]["uid"]

        ok, uid = run(publishing(api, [gpu(0)], body))
        assert ok
        [piece] = api.resource_slices(DRIVER, NODE)
        assert piece["metadata"]["ownerReferences"][0]["uid"] == uid


def test_a_refused_watch_is_said_once(run, caplog):
    with ApiServerStandIn() as api:
        api.add_node(NODE)
        api.fail_next(403, count=3, verbs={"watch"}, reason="Forbidden",
                      message='resourceslices.resource.k8s.io is forbidden: cannot "watch"')

        async def body(publisher):
            assert await publisher.wait_synced()
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 5
            while api.watches < 4 and loop.time() < deadline:
                await asyncio.sleep(0.01)
            return api.watches

        with caplog.at_level(logging.WARNING, logger="host.dra.publisher"):
            assert run(publishing(api, [gpu(0)], body)) >= 4
        said = [r for r in caplog.records if "cannot watch ResourceSlices" in r.getMessage()]
        assert len(said) == 1 and "forbidden" in said[0].getMessage()


def test_a_republish_while_a_reconcile_deletes_slices_does_not_kill_the_publisher(run):
    # republish() (a kubelet restart) or a watched deletion can drop the pool's view while a
    # reconcile is between its update and its deletion of a slice no longer needed.
    with ApiServerStandIn() as api:
        api.add_node(NODE)

        async def body(publisher):
            assert await publisher.wait_synced()

            def on_write(verb, obj):
                if verb == "update":
                    api.on_write = None
                    publisher.republish()  # from the server's thread, as the hook runs

            api.on_write = on_write
            publisher.set_pool(DRIVER, POOL, [gpu(i) for i in range(10)])  # 2 slices -> 1
            assert await publisher.wait_synced()
            publisher.set_pool(DRIVER, POOL, [gpu(i) for i in range(11)])
            assert await publisher.wait_synced()  # the owner task still runs

        run(publishing(api, [gpu(i) for i in range(130)], body))
        assert len(api.resource_slices(DRIVER, NODE)) == 1
        assert len(api.devices(DRIVER, NODE)) == 11
