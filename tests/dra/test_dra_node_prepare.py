"""NodePrepareResources / NodeUnprepareResources end to end: API server (stand-in, or the real
one with KUBEBUILDER_ASSETS), the DRA front end serving over real unix sockets, and the DRA
kubelet simulator calling it as the kubelet's DRA manager does."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import uuid

import pytest

from host.dra import naming
from host.dra.checkpoint import FILE_NAME
from host.dra.frontend import DraFrontEnd
from host.dra.kube import KubeClient
from host.isolation import DriverCalls
from host.model import Health, ResourceConfig
from host.testing.apiserver import kube_api
from host.testing.cdi_runtime import CdiCache, container_cdi_ids
from host.testing.drivers import MemoryDriver, SlowAllocateDriver, make_devices
from host.testing.kubelet_dra import DraKubeletSimulator, PrepareError

__all__ = ["kube_api"]  # the API server fixture: real with KUBEBUILDER_ASSETS

NODE = "node-1"
RESOURCE = ResourceConfig(name="example.com/gpu", driver="memory", api="dra")
DRIVER = naming.driver_name(RESOURCE.name, None)
POOL = naming.pool_name(RESOURCE.name, NODE)


class Node:
    """One node: the front end (what HostApp builds for DRA resources) and a kubelet."""

    def __init__(self, root: str, api, driver: MemoryDriver) -> None:
        self.root = root
        self.api = api
        self.driver = driver
        self.registry = os.path.join(root, "registry")
        self.plugins = os.path.join(root, "plugins")
        self.state = os.path.join(root, "state")
        self.cdi = os.path.join(root, "cdi")
        self.client = None
        self.front = None
        self.kubelet = None
        self.calls = None

    async def start_host(self) -> None:
        self.calls = DriverCalls()
        self.client = KubeClient.from_settings(self.api.kubeconfig_path)
        self.front = DraFrontEnd(node_name=NODE, claims=self.client, calls=self.calls,
                                 registry_dir=self.registry, plugins_dir=self.plugins,
                                 state_dir=self.state, cdi_dir=self.cdi, allocate_timeout_s=2)
        self.front.sync(RESOURCE, self.driver, self.driver.devices[RESOURCE.name])

    async def stop_host(self) -> None:
        await self.front.close()
        await self.client.close()
        self.calls.shutdown()

    async def start_kubelet(self) -> None:
        self.kubelet = DraKubeletSimulator(
            self.registry, get_claim=self.client.get_resource_claim, node_name=NODE,
            wipe_slices=self.api.delete_slices_of_node, plugins_dir=self.plugins)
        await self.kubelet.start()
        await self.kubelet.wait_registered(DRIVER)

    def claim(self, devices, pod_uid: str, name: str = "claim-1", request: str = "gpu",
              reserved: bool = True, driver: str = DRIVER, pool: str = POOL):
        return self.claim_of({request: devices}, pod_uid, name=name, reserved=reserved,
                             driver=driver, pool=pool)

    def claim_of(self, requests, pod_uid: str, name: str = "claim-1", reserved: bool = True,
                 driver: str = DRIVER, pool: str = POOL, tolerations=None):
        """A claim allocated with {request: [device, ...]}; ``tolerations`` on every result
        (and its request), as the scheduler copies them into the allocation."""
        results = []
        for request, devices in requests.items():
            for d in devices:
                result = {"request": request, "driver": driver, "pool": pool, "device": d}
                if tolerations:
                    result["tolerations"] = tolerations
                results.append(result)
        status = {"allocation": {"devices": {"results": results}}}
        if reserved:
            status["reservedFor"] = [{"resource": "pods", "name": "pod-a", "uid": pod_uid}]
        spec_requests = []
        for request, devices in requests.items():
            exactly = {"deviceClassName": "gpu", "count": len(devices)}
            if tolerations:
                exactly["tolerations"] = tolerations
            spec_requests.append({"name": request, "exactly": exactly})
        return self.api.put_resource_claim({
            "metadata": {"name": name, "namespace": "default"},
            "spec": {"devices": {"requests": spec_requests}},
            "status": status,
        })


@contextlib.asynccontextmanager
async def node(root, api, driver):
    api.add_node(NODE)
    n = Node(root, api, driver)
    await n.start_host()
    try:
        await n.start_kubelet()
        yield n
    finally:
        if n.kubelet is not None:
            await n.kubelet.stop()
        await n.stop_host()


def _driver(count: int = 4) -> MemoryDriver:
    return MemoryDriver(devices={RESOURCE.name: make_devices("gpu", count)})


def _specs(cdi_dir: str):
    return sorted(os.listdir(cdi_dir)) if os.path.isdir(cdi_dir) else []


def test_prepare_writes_a_cdi_spec_and_unprepare_removes_it(short_dir, run, kube_api):
    async def body():
        async with node(short_dir, kube_api, _driver()) as n:
            pod = str(uuid.uuid4())
            claim = n.claim(["gpu1", "gpu2"], pod)
            uid = claim["metadata"]["uid"]
            [info] = await n.kubelet.prepare(pod, [("default", "claim-1")])
            assert info.prepared
            devices = info.devices[DRIVER]
            assert [(d.pool_name, d.device_name, d.request_names) for d in devices] == [
                (POOL, "gpu1", ["gpu"]), (POOL, "gpu2", ["gpu"])]
            [spec_file] = _specs(n.cdi)
            with open(os.path.join(n.cdi, spec_file)) as stream:
                spec = json.load(stream)
            names = {f"{spec['kind']}={d['name']}": d for d in spec["devices"]}
            for device in devices:  # every returned CDI id exists in a spec on disk
                assert len(device.cdi_device_ids) == 2
                assert set(device.cdi_device_ids) <= set(names)
            nodes = [n["path"] for e in names.values()
                     for n in e["containerEdits"].get("deviceNodes", ())]
            assert sorted(nodes) == ["/dev/gpu1", "/dev/gpu2"]
            assert "containerEdits" not in spec  # nothing reaches containers of other requests
            [last] = {d.cdi_device_ids[-1] for d in devices}  # the request's joined env
            assert names[last]["containerEdits"] == {"env": ["VISIBLE=gpu1,gpu2"]}
            assert info.cdi_devices("gpu") == info.cdi_devices() and info.cdi_devices("x") == []
            assert uid in n.front.checkpoint.claims
            await n.kubelet.unprepare(pod)
            assert _specs(n.cdi) == []
            assert n.front.checkpoint.claims == {}

    run(body())


def test_prepare_is_idempotent_and_survives_a_kubelet_restart(short_dir, run, kube_api):
    async def body():
        async with node(short_dir, kube_api, _driver()) as n:
            pod = str(uuid.uuid4())
            n.claim(["gpu0"], pod)
            [first] = await n.kubelet.prepare(pod, [("default", "claim-1")])
            before = [d.cdi_device_ids for d in first.devices[DRIVER]]
            await n.kubelet.restart(wipe_sockets=True)  # wipes slices and our sockets
            await n.kubelet.wait_registered(DRIVER)
            [again] = await n.kubelet.prepare(pod, [("default", "claim-1")])
            assert [d.cdi_device_ids for d in again.devices[DRIVER]] == before
            assert len(_specs(n.cdi)) == 1
            await n.kubelet.unprepare(pod)
            assert _specs(n.cdi) == []

    run(body())


def test_host_restart_with_prepared_claims_can_still_unprepare(short_dir, run, kube_api):
    async def body():
        async with node(short_dir, kube_api, _driver()) as n:
            pod = str(uuid.uuid4())
            claim = n.claim(["gpu3"], pod)
            await n.kubelet.prepare(pod, [("default", "claim-1")])
            await n.stop_host()  # the host process ends; the kubelet keeps running
            assert os.path.exists(os.path.join(n.state, FILE_NAME))
            kube_api.delete_resource_claim("default", "claim-1")  # gone from the API too
            await n.start_host()
            await n.kubelet.wait_registered(DRIVER)
            assert claim["metadata"]["uid"] in n.front.checkpoint.claims
            assert len(_specs(n.cdi)) == 1
            await n.kubelet.unprepare(pod)
            assert _specs(n.cdi) == [] and n.front.checkpoint.claims == {}

    run(body())


def test_refusals_are_per_claim_errors(short_dir, run, kube_api):
    async def body():
        driver = _driver()
        async with node(short_dir, kube_api, driver) as n:
            pod = str(uuid.uuid4())
            n.claim(["gpu0"], pod, name="good")
            n.claim(["nope"], pod, name="unknown-device")
            n.claim(["gpu1"], pod, name="other-pool", pool="node-2/example.com/gpu")
            sick = make_devices("gpu", 4)
            sick[2] = sick[2].with_health(Health.UNHEALTHY, "ECC errors")
            n.front.sync(RESOURCE, driver, sick)
            n.claim(["gpu2"], pod, name="unhealthy")
            claims = {}
            for name in ("good", "unknown-device", "other-pool", "unhealthy"):
                obj = await n.client.get_resource_claim("default", name)
                claims[name] = obj["metadata"]["uid"]
            wrong_uid = str(uuid.uuid4())
            response = await n.kubelet.node_prepare(DRIVER, [
                *(("default", k, v) for k, v in claims.items()),
                ("default", "good", wrong_uid),
                ("default", "missing", str(uuid.uuid4())),
            ])
            errors = {k: response.claims[v].error for k, v in claims.items()}
            assert errors["good"] == "" and len(response.claims[claims["good"]].devices) == 1
            assert "not in pool" in errors["unknown-device"]
            assert "is not served by driver" in errors["other-pool"]
            assert "Unhealthy: ECC errors" in errors["unhealthy"]
            assert "deleted and created again" in response.claims[wrong_uid].error
            assert len(response.claims) == 6
            assert any("not found" in r.error for r in response.claims.values())
            assert len(_specs(n.cdi)) == 1  # only the good claim

    run(body())


def test_kubelet_pre_checks(short_dir, run, kube_api):
    async def body():
        async with node(short_dir, kube_api, _driver()) as n:
            pod = str(uuid.uuid4())
            n.claim(["gpu0"], str(uuid.uuid4()), name="someone-elses")
            with pytest.raises(PrepareError, match="not allowed to use"):
                await n.kubelet.prepare(pod, [("default", "someone-elses")])
            n.claim(["gpu0"], pod, name="foreign", driver="other.example.com")
            with pytest.raises(PrepareError, match=r"other\.example\.com is not registered"):
                await n.kubelet.prepare(pod, [("default", "foreign")])
            # Unprepare after a prepare our plugin failed (the kubelet always does it).
            other = str(uuid.uuid4())
            n.claim(["gone"], other, name="fails")
            with pytest.raises(PrepareError, match="not in pool"):
                await n.kubelet.prepare(other, [("default", "fails")])
            await n.kubelet.unprepare(other)
            assert n.kubelet.claims.keys() == {
                c.uid for c in n.kubelet.claims.values() if c.name == "foreign"}

    run(body())


def test_unprepare_of_an_unknown_claim_succeeds_and_v1beta1_works(short_dir, run, kube_api):
    async def body():
        async with node(short_dir, kube_api, _driver()) as n:
            uid = str(uuid.uuid4())
            response = await n.kubelet.node_unprepare(DRIVER, [("default", "x", uid)],
                                                      service="v1beta1.DRAPlugin")
            assert uid in response.claims and response.claims[uid].error == ""
            # and a whole cycle on v1beta1
            pod = str(uuid.uuid4())
            claim = n.claim(["gpu1"], pod)
            cuid = claim["metadata"]["uid"]
            prepared = await n.kubelet.node_prepare(
                DRIVER, [("default", "claim-1", cuid)], service="v1beta1.DRAPlugin")
            assert type(prepared).__module__.endswith("dra_v1beta1_pb2")
            assert [d.device_name for d in prepared.claims[cuid].devices] == ["gpu1"]
            await n.kubelet.node_unprepare(DRIVER, [("default", "claim-1", cuid)],
                                           service="v1beta1.DRAPlugin")
            assert _specs(n.cdi) == []

    run(body())


def test_a_hanging_allocate_hook_fails_the_claim_not_the_host(short_dir, run, kube_api):
    class Broken(SlowAllocateDriver):
        def allocate(self, resource, devices, merged):
            if devices[0].id == "gpu0":
                raise RuntimeError("firmware says no")
            return super().allocate(resource, devices, merged)

    async def body():
        driver = Broken("memory", {RESOURCE.name: make_devices("gpu", 3)}, delay=5)
        async with node(short_dir, kube_api, driver) as n:
            pod = str(uuid.uuid4())
            n.claim(["gpu0"], pod, name="raises")
            n.claim(["gpu1"], pod, name="hangs")
            with pytest.raises(PrepareError, match="firmware says no"):
                await n.kubelet.prepare(pod, [("default", "raises")])
            with pytest.raises(PrepareError, match="no answer within 2 s"):
                await n.kubelet.prepare(pod, [("default", "hangs")])
            assert _specs(n.cdi) == []
            driver.delay = 0
            n.claim(["gpu2"], pod, name="fine")
            [info] = await n.kubelet.prepare(pod, [("default", "fine")])
            assert info.prepared

    run(body())


def test_a_retry_during_a_slow_prepare_gets_the_same_answer_and_one_hook_call(short_dir, run,
                                                                                kube_api):
    class Counting(SlowAllocateDriver):
        calls = 0

        def allocate(self, resource, devices, merged):
            Counting.calls += 1
            return super().allocate(resource, devices, merged)

    async def body():
        driver = Counting("memory", {RESOURCE.name: make_devices("gpu", 2)}, delay=0.5)
        async with node(short_dir, kube_api, driver) as n:
            pod = str(uuid.uuid4())
            claim = n.claim(["gpu0"], pod)
            uid = claim["metadata"]["uid"]
            claims = [("default", "claim-1", uid)]
            first, second = await asyncio.gather(n.kubelet.node_prepare(DRIVER, claims),
                                                 n.kubelet.node_prepare(DRIVER, claims))
            assert first == second and first.claims[uid].error == ""
            assert Counting.calls == 1
            assert n.front.services[DRIVER]._locks == {}

    run(body())


def test_prepare_again_after_a_reboot_emptied_the_cdi_dir_rewrites_the_spec(short_dir, run,
                                                                            kube_api):
    async def body():
        async with node(short_dir, kube_api, _driver()) as n:
            pod = str(uuid.uuid4())
            n.claim(["gpu1"], pod)
            [first] = await n.kubelet.prepare(pod, [("default", "claim-1")])
            for name in _specs(n.cdi):  # /var/run/cdi is a tmpfs: a reboot empties it
                os.unlink(os.path.join(n.cdi, name))
            await n.kubelet.restart(wipe_sockets=True)
            await n.kubelet.wait_registered(DRIVER)
            [again] = await n.kubelet.prepare(pod, [("default", "claim-1")])
            ids = again.cdi_devices()
            assert ids == first.cdi_devices()
            [spec_file] = _specs(n.cdi)
            with open(os.path.join(n.cdi, spec_file)) as stream:
                spec = json.load(stream)
            assert {f"{spec['kind']}={d['name']}" for d in spec["devices"]} == set(ids)

    run(body())


def test_device_health_streams_to_the_kubelet(short_dir, run, kube_api):
    """DRAResourceHealth/NodeWatchResources: the full list at once, again on every change."""
    async def body():
        driver = _driver(3)
        async with node(short_dir, kube_api, driver) as n:
            kubelet = n.kubelet
            await kubelet.watcher.wait_for(lambda w: kubelet.health_messages >= 1,
                                           what="the first health message")
            assert [kubelet.health(DRIVER, POOL, f"gpu{i}") for i in range(3)] == [
                ("Healthy", "")] * 3
            sick = make_devices("gpu", 3)
            sick[1] = sick[1].with_health(Health.UNHEALTHY, "ECC errors")
            n.front.sync(RESOURCE, driver, sick)
            await kubelet.watcher.wait_for(
                lambda w: kubelet.health(DRIVER, POOL, "gpu1")[0] == "Unhealthy",
                what="the Unhealthy device streamed")
            assert kubelet.health(DRIVER, POOL, "gpu1") == ("Unhealthy", "ECC errors")
            n.front.sync(RESOURCE, driver, make_devices("gpu", 3))
            await kubelet.watcher.wait_for(
                lambda w: kubelet.health(DRIVER, POOL, "gpu1")[0] == "Healthy",
                what="healthy again")
            before = kubelet.health_messages
            await kubelet.restart(wipe_sockets=True)  # a new stream with the new plugin
            await kubelet.wait_registered(DRIVER)
            await kubelet.watcher.wait_for(lambda w: kubelet.health_messages > before,
                                           what="the stream after a kubelet restart")
            assert n.front.services[DRIVER].health_streams == 1  # the old one is gone

    run(body())


def test_health_is_advertised_for_kubelets_that_watch_only_advertised_services(short_dir, run,
                                                                               kube_api):
    """Newer DRA plugin managers (pickHealthService) start NodeWatchResources only for a
    plugin whose supported_versions name the health service, as upstream's kubelet plugin
    helper lists it; older ones ignore entries they do not know."""
    async def body():
        async with node(short_dir, kube_api, _driver(2)) as n:
            kubelet = n.kubelet
            kubelet.health_requires_advertised = True
            await kubelet.restart(wipe_sockets=True)
            before = kubelet.health_messages
            await kubelet.wait_registered(DRIVER)
            assert kubelet.plugin(DRIVER).chosen_service == "v1.DRAPlugin"
            await kubelet.watcher.wait_for(lambda w: kubelet.health_messages > before,
                                           what="the health stream of a newer kubelet")
            assert kubelet.health(DRIVER, POOL, "gpu0") == ("Healthy", "")

    run(body())


def _containers(n, pod_claims, containers):
    """Each container's OCI edits after the runtime injected the CDI ids the kubelet gives it:
    ``pod_claims`` are (pod claim name, prepared ClaimInfo) in pod order, ``containers`` map a
    container name to its (claim, request) references."""
    cache = CdiCache(n.cdi)
    assert cache.errors == {}
    return {name: cache.inject(container_cdi_ids(pod_claims, refs))
            for name, refs in containers.items()}


def test_each_container_of_a_two_request_claim_sees_only_its_own_devices(short_dir, run,
                                                                          kube_api):
    async def body():
        async with node(short_dir, kube_api, _driver(4)) as n:
            pod = str(uuid.uuid4())
            n.claim_of({"train": ["gpu0", "gpu2"], "serve": ["gpu1"]}, pod, name="gpus")
            [info] = await n.kubelet.prepare(pod, [("default", "gpus")])
            seen = _containers(n, [("gpus", info)], {
                "trainer": [("gpus", "train")], "server": [("gpus", "serve")],
            })
            assert seen["trainer"].device_paths() == ["/dev/gpu0", "/dev/gpu2"]
            assert seen["trainer"].environ() == {"VISIBLE": "gpu0,gpu2"}
            assert seen["server"].device_paths() == ["/dev/gpu1"]
            assert seen["server"].environ() == {"VISIBLE": "gpu1"}

    run(body())


def test_two_claims_in_one_container_name_no_device_of_another_container(short_dir, run,
                                                                         kube_api):
    """CDI merges env by replacing: a variable two claims set is the later claim's in that
    container (what no plugin can merge, since the kubelet gives each claim's ids to every
    container that references it). Every device node arrives, and no container is told about a
    device it did not receive."""
    async def body():
        async with node(short_dir, kube_api, _driver(4)) as n:
            pod = str(uuid.uuid4())
            n.claim_of({"a": ["gpu0"], "b": ["gpu1"]}, pod, name="pair")
            n.claim_of({"gpu": ["gpu2", "gpu3"]}, pod, name="more")
            infos = await n.kubelet.prepare(pod, [("default", "pair"), ("default", "more")])
            pair, more = infos
            seen = _containers(n, [("pair", pair), ("more", more)], {
                "both": [("pair", "a"), ("more", "")], "other": [("pair", "b")],
                "more-first": [("more", ""), ("pair", "a")],
            })
            assert seen["both"].device_paths() == ["/dev/gpu0", "/dev/gpu2", "/dev/gpu3"]
            assert seen["both"].environ() == {"VISIBLE": "gpu2,gpu3"}
            assert seen["more-first"].environ() == {"VISIBLE": "gpu2,gpu3"}  # pod order
            assert seen["other"].device_paths() == ["/dev/gpu1"]
            assert seen["other"].environ() == {"VISIBLE": "gpu1"}
            for container in seen.values():
                visible = set(container.environ()["VISIBLE"].split(","))
                assert {f"/dev/{d}" for d in visible} <= set(container.device_paths())

    run(body())
