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

from device_plugin_host_testing.cdi_runtime import CdiCache, container_cdi_ids
from device_plugin_host_testing.drivers import MemoryDriver, SlowAllocateDriver, make_devices
from host.core.hostfs import HostFS
from host.core.isolation import DriverCalls
from host.core.model import Device, DeviceNode, Health, ResourceConfig
from host.dra import naming
from host.dra.checkpoint import FILE_NAME
from host.dra.frontend import DraFrontEnd
from host.dra.kube import KubeClient
from host.dra.taints import TAINT_KEY
from host.sim.apiserver import kube_api
from host.sim.kubelet_dra import DraKubeletSimulator, PrepareError

__all__ = ["kube_api"]  # the API server fixture: real with KUBEBUILDER_ASSETS

NODE = "node-1"
RESOURCE = ResourceConfig(name="example.com/gpu", driver="memory", api="dra")
DRIVER = naming.driver_name(RESOURCE.name, None)
POOL = naming.pool_name(RESOURCE.name, NODE)


class Node:
    """One node: the front end (what HostApp builds for DRA resources) and a kubelet."""

    def __init__(self, root: str, api, driver: MemoryDriver, resources=(RESOURCE,)) -> None:
        self.root = root
        self.resources = resources
        self.api = api
        self.driver = driver
        self.registry = os.path.join(root, "registry")
        self.plugins = os.path.join(root, "plugins")
        self.state = os.path.join(root, "state")
        self.cdi = os.path.join(root, "cdi")
        self.hostroot = os.path.join(root, "hostroot")  # what --host-root shows the host
        self.boot("boot-1")
        self.client = None
        self.front = None
        self.kubelet = None
        self.calls = None

    def boot(self, boot_id: str) -> None:
        """The kernel's boot id the host reads (a reboot changes it)."""
        path = os.path.join(self.hostroot, "proc/sys/kernel/random/boot_id")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as stream:
            stream.write(boot_id + "\n")

    async def start_host(self) -> None:
        self.calls = DriverCalls()
        self.client = KubeClient.from_settings(self.api.kubeconfig_path)
        self.front = DraFrontEnd(node_name=NODE, claims=self.client, calls=self.calls,
                                 registry_dir=self.registry, plugins_dir=self.plugins,
                                 state_dir=self.state, cdi_dir=self.cdi, allocate_timeout_s=2,
                                 host=HostFS(self.hostroot))
        for resource in self.resources:
            self.front.sync(resource, self.driver, self.driver.devices[resource.name])

    async def stop_host(self) -> None:
        await self.front.close()
        await self.client.close()
        self.calls.shutdown()

    async def start_kubelet(self) -> None:
        self.kubelet = DraKubeletSimulator(
            self.registry, node_name=NODE,
            get_claim=lambda ns, name: self.client.get_resource_claim(ns, name),  # the current
            wipe_slices=self.api.delete_slices_of_node, plugins_dir=self.plugins)
        await self.kubelet.start()
        await self.kubelet.wait_registered(DRIVER)

    def claim(self, devices, pod_uid: str, name: str = "claim-1", request: str = "gpu",
              reserved: bool = True, driver: str = DRIVER, pool: str = POOL):
        return self.claim_of({request: devices}, pod_uid, name=name, reserved=reserved,
                             driver=driver, pool=pool)

    def pod(self, name: str, claims, containers) -> str:
        """A Pod in the API server whose ``containers`` map a container name to its
        (claim, request) references ("" the whole claim), each pod claim naming the
        ResourceClaim of the same name; its uid."""
        spec = {
            "resourceClaims": [{"name": c, "resourceClaimName": c} for c in claims],
            "containers": [
                {"name": c, "image": "registry.k8s.io/pause:3.10",
                 "resources": {"claims": [dict({"name": claim}, **({"request": r} if r else {}))
                                          for claim, r in refs]}}
                for c, refs in containers.items()],
        }
        stored = self.api.put_pod({"metadata": {"name": name, "namespace": "default"},
                                   "spec": spec})
        return stored["metadata"]["uid"]

    def claim_of(self, requests, pod_uid: str, name: str = "claim-1", reserved: bool = True,
                 driver: str = DRIVER, pool: str = POOL, tolerations=None,
                 pod_name: str = "pod-a"):
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
            status["reservedFor"] = [{"resource": "pods", "name": pod_name, "uid": pod_uid}]
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
async def node(root, api, driver, resources=(RESOURCE,)):
    api.add_node(NODE)
    n = Node(root, api, driver, resources)
    await n.start_host()
    try:
        await n.start_kubelet()
        for resource in resources[1:]:
            await n.kubelet.wait_registered(naming.driver_name(resource.name, None))
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
            # Both health services are listed: a kubelet that knows v1 streams v1.
            assert kubelet.health_services[DRIVER] == "v1.DRAResourceHealth"

    run(body())


def test_the_v1_health_stream_carries_the_unhealthy_reason_and_the_timeout(short_dir, run,
                                                                          kube_api):
    """dra-health/v1 over a real socket: a newer kubelet's stream gets each device's reason
    as ``message`` (cut as the kubelet cuts it) and our timeout; v1alpha1 stays served for
    1.36 kubelets on the same server."""
    async def body():
        driver = _driver(2)
        async with node(short_dir, kube_api, driver) as n:
            kubelet = n.kubelet
            kubelet.health_requires_advertised = True
            await kubelet.restart(wipe_sockets=True)
            await kubelet.wait_registered(DRIVER)
            sick = make_devices("gpu", 2)
            sick[0] = sick[0].with_health(Health.UNHEALTHY,
                                          "drained by an operator: " + "x" * 2000)
            n.front.sync(RESOURCE, driver, sick)
            await kubelet.watcher.wait_for(
                lambda w: kubelet.health(DRIVER, POOL, "gpu0")[0] == "Unhealthy",
                what="the Unhealthy device on the v1 stream")
            _, message = kubelet.health(DRIVER, POOL, "gpu0")
            assert message.startswith("drained by an operator: xxx") and len(message) == 1024
            assert kubelet.health_services[DRIVER] == "v1.DRAResourceHealth"
            assert kubelet.device_health[DRIVER][f"{POOL}/gpu0"].timeout_s == 60.0
            from host.dra.protocol import dra_health, dra_health_v1
            for service, api in (("v1.DRAResourceHealth", dra_health_v1),
                                 ("v1alpha1.DRAResourceHealth", dra_health)):
                call = kubelet._channel(kubelet.plugin(DRIVER)).unary_stream(
                    f"/{service}/NodeWatchResources",
                    request_serializer=api.NodeWatchResourcesRequest.SerializeToString,
                    response_deserializer=api.NodeWatchResourcesResponse.FromString)
                stream = call(api.NodeWatchResourcesRequest())
                first = await stream.read()
                stream.cancel()
                got = {d.device.device_name: (d.health, d.message[:24],
                                              d.health_check_timeout_seconds)
                       for d in first.devices}
                assert got == {"gpu0": (api.UNHEALTHY, "drained by an operator: ", 60),
                               "gpu1": (api.HEALTHY, "", 60)}, service

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


def test_two_claims_in_one_container_without_a_readable_pod_keep_env_per_request(
        short_dir, run, kube_api, caplog):
    """The claims' pod cannot be read (here: it is not in the API server; RBAC and outages
    alike): each request's env names that request's devices, so a variable two claims set is
    the later claim's in a container that references both (CDI replaces, never merges); one
    warning per claim, counted. Every device node arrives, and no container is told about a
    device it did not receive."""
    async def body():
        async with node(short_dir, kube_api, _driver(4)) as n:
            pod = str(uuid.uuid4())
            n.claim_of({"a": ["gpu0"], "b": ["gpu1"]}, pod, name="pair")
            n.claim_of({"gpu": ["gpu2", "gpu3"]}, pod, name="more")
            with caplog.at_level("WARNING", logger="host.dra.service"):
                infos = await n.kubelet.prepare(pod, [("default", "pair"),
                                                      ("default", "more")])
            warned = [r.getMessage() for r in caplog.records
                      if "lists only that request's devices" in r.getMessage()]
            assert len(warned) == 2 and all("cannot read Pod default/pod-a: HTTP 404" in w
                                            for w in warned), warned
            assert n.front.services[DRIVER].env_fallbacks == 2
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


MIG = ResourceConfig(name="example.com/mig", driver="memory", api="dra")
MIG_DRIVER = naming.driver_name(MIG.name, None)
MIG_POOL = naming.pool_name(MIG.name, NODE)
GPU_ADDRESS = "0000:3b:00.0"


def _gpu():
    return Device(id=GPU_ADDRESS, attributes={"pci_address": GPU_ADDRESS},
                  device_nodes=(DeviceNode("/dev/nvidia6"), DeviceNode("/dev/nvidiactl")),
                  env={"NVIDIA_VISIBLE_DEVICES": "GPU-6"})


def _migs():
    return [Device(id=f"{GPU_ADDRESS}-gi{gi}-ci0",
                   attributes={"pci_address": GPU_ADDRESS, "mig_gi": str(gi), "mig_ci": "0"},
                   device_nodes=(DeviceNode("/dev/nvidia6"),
                                 DeviceNode(f"/dev/nvidia-caps/nvidia-cap{gi}"),
                                 DeviceNode("/dev/nvidiactl")),
                   env={"NVIDIA_VISIBLE_DEVICES": f"MIG-6/{gi}/0"})
            for gi in (1, 2)]


def test_a_gpu_and_its_own_mig_device_are_never_prepared_for_two_claims(short_dir, run,
                                                                        kube_api):
    """The whole GPU is prepared; the GPU goes into MIG mode (the whole device leaves its
    pool, MIG devices appear in another driver's pool); a claim for a MIG device is refused
    while the whole GPU's claim is prepared, across a host restart, and prepared once that
    claim is unprepared. Two MIG devices of the GPU are no conflict."""
    async def body():
        driver = MemoryDriver(devices={RESOURCE.name: [_gpu()], MIG.name: []})
        async with node(short_dir, kube_api, driver, (RESOURCE, MIG)) as n:
            pod, other = str(uuid.uuid4()), str(uuid.uuid4())
            whole = n.claim([naming.dra_device_name(GPU_ADDRESS)], pod,
                            name="whole")
            await n.kubelet.prepare(pod, [("default", "whole")])
            driver.devices = {RESOURCE.name: [], MIG.name: _migs()}
            n.front.sync(RESOURCE, driver, [])
            n.front.sync(MIG, driver, _migs())
            names = sorted(n.front.pools[MIG.name].by_name)
            n.claim_of({"mig": [names[0]]}, other, name="slice-1", driver=MIG_DRIVER,
                       pool=MIG_POOL)
            n.claim_of({"mig": [names[1]]}, other, name="slice-2", driver=MIG_DRIVER,
                       pool=MIG_POOL)
            with pytest.raises(PrepareError, match=(
                    rf"overlaps .* of claim default/whole \({whole['metadata']['uid']}\), "
                    rf"prepared on this node and not unprepared: PCI function {GPU_ADDRESS} "
                    rf"and its partition mig:1/0")):
                await n.kubelet.prepare(other, [("default", "slice-1")])
            await n.stop_host()  # the knowledge is in the checkpoint
            await n.start_host()
            await n.kubelet.wait_registered(MIG_DRIVER)
            with pytest.raises(PrepareError, match="overlaps"):
                await n.kubelet.prepare(other, [("default", "slice-1")])
            assert not any("mig" in f for f in _specs(n.cdi))
            await n.kubelet.unprepare(pod)
            infos = await n.kubelet.prepare(other, [("default", "slice-1"),
                                                    ("default", "slice-2")])
            assert all(i.prepared for i in infos)
            # and now the whole GPU cannot be prepared for a third claim
            driver.devices = {RESOURCE.name: [_gpu()], MIG.name: _migs()}
            n.front.sync(RESOURCE, driver, [_gpu()])
            third = str(uuid.uuid4())
            n.claim([naming.dra_device_name(GPU_ADDRESS)], third, name="again")
            with pytest.raises(PrepareError, match=r"overlaps .* of claim default/slice-[12]"):
                await n.kubelet.prepare(third, [("default", "again")])

    run(body())


def test_overlapping_claims_in_one_call_get_one_device_not_two(short_dir, run, kube_api):
    """Two claims for one device in one NodePrepareResources call are prepared at once: the
    hold taken before the first await makes the second one see the first."""
    async def body():
        async with node(short_dir, kube_api, _driver(2)) as n:
            pod = str(uuid.uuid4())
            uids = [n.claim(["gpu1"], pod, name=f"twin-{i}")["metadata"]["uid"]
                    for i in range(2)]
            response = await n.kubelet.node_prepare(
                DRIVER, [("default", f"twin-{i}", uids[i]) for i in range(2)])
            errors = sorted(response.claims[u].error for u in uids)
            assert errors[0] == ""
            assert "the same device node /dev/gpu1" in errors[1]
            assert len(_specs(n.cdi)) == 1 and n.front.checkpoint.reserved == {}

    run(body())


def test_a_claim_that_tolerates_a_devices_taint_is_prepared(short_dir, run, kube_api, caplog):
    """dra_unhealthy = "taint": a drained device carries a NoSchedule taint; a claim allocated
    with a toleration for it is prepared (with a warning naming the taint), one without is
    refused, and a device that cannot work is refused whatever the claim tolerates."""
    async def body():
        driver = _driver(4)
        async with node(short_dir, kube_api, driver) as n:
            n.front.taint_unhealthy = True
            sick = make_devices("gpu", 4)
            sick[0] = sick[0].with_health(Health.UNHEALTHY, "drained by an operator: burn-in")
            sick[1] = sick[1].with_health(Health.UNHEALTHY, "drained by an operator: burn-in")
            sick[2] = sick[2].with_health(Health.UNHEALTHY, "gone from the host")
            sick[3] = sick[3].with_health(Health.UNHEALTHY, "no kernel driver bound")
            n.front.sync(RESOURCE, driver, sick)
            pod = str(uuid.uuid4())
            everything = [{"operator": "Exists"}]
            n.claim_of({"gpu": ["gpu0"]}, pod, name="diagnostic",
                       tolerations=[{"key": TAINT_KEY, "operator": "Exists",
                                     "effect": "NoSchedule"}])
            n.claim_of({"gpu": ["gpu1"]}, pod, name="plain")
            n.claim_of({"gpu": ["gpu2"]}, pod, name="gone", tolerations=everything)
            n.claim_of({"gpu": ["gpu3"]}, pod, name="unbound",
                       tolerations=[{"operator": "Exists", "effect": "NoSchedule"}])
            uids = {name: (await n.client.get_resource_claim("default", name))["metadata"]["uid"]
                    for name in ("diagnostic", "plain", "gone", "unbound")}
            with caplog.at_level("WARNING", logger="host.dra.service"):
                response = await n.kubelet.node_prepare(
                    DRIVER, [("default", k, v) for k, v in uids.items()])
            errors = {k: response.claims[v].error for k, v in uids.items()}
            assert errors["diagnostic"] == ""
            assert [d.device_name for d in response.claims[uids["diagnostic"]].devices] == \
                ["gpu0"]
            assert any("tolerates the taint device-plugin-host.io/unhealthy=drained-by-an-"
                       "operator-burn-in:NoSchedule" in r.getMessage() for r in caplog.records)
            assert "does not tolerate its taint device-plugin-host.io/unhealthy=" \
                   "drained-by-an-operator-burn-in:NoSchedule" in errors["plain"]
            assert "cannot work: gone from the host" in errors["gone"]
            assert "does not tolerate its taint device-plugin-host.io/unhealthy=" \
                   "no-kernel-driver-bound:NoExecute" in errors["unbound"]
            n.front.taint_unhealthy = False  # dra_unhealthy = "omit": never published
            n.claim_of({"gpu": ["gpu1"]}, pod, name="late", tolerations=everything)
            with pytest.raises(PrepareError, match="is Unhealthy: drained by an operator"):
                await n.kubelet.prepare(pod, [("default", "late")])

    run(body())


def _spec_texts(cdi_dir):
    out = {}
    for name in _specs(cdi_dir):
        with open(os.path.join(cdi_dir, name)) as stream:
            out[name] = stream.read()
    return out


def test_a_reboot_drops_the_old_boots_claims_and_a_lost_spec_is_written_at_start(
        short_dir, run, kube_api, caplog):
    async def body():
        async with node(short_dir, kube_api, _driver()) as n:
            pod = str(uuid.uuid4())
            n.claim(["gpu1"], pod)
            [first] = await n.kubelet.prepare(pod, [("default", "claim-1")])
            written = _spec_texts(n.cdi)
            # Same boot: the host restarts and finds its spec gone (/var/run/cdi emptied).
            await n.stop_host()
            for name in written:
                os.unlink(os.path.join(n.cdi, name))
            await n.start_host()
            assert _spec_texts(n.cdi) == written  # before any prepare call
            assert first.uid in n.front.checkpoint.claims
            # A reboot: new boot id, /var/run/cdi empty; the claim of the old boot is gone,
            # so it neither blocks its device for another claim nor stays listed.
            await n.stop_host()
            for name in written:
                os.unlink(os.path.join(n.cdi, name))
            n.boot("boot-2")
            with caplog.at_level("WARNING", logger="host.dra.checkpoint"):
                await n.start_host()
            assert n.front.checkpoint.claims == {} and _specs(n.cdi) == []
            assert any("dropped 1 claim prepared before the last reboot (boot boot-1)"
                       in r.getMessage() for r in caplog.records)
            with open(os.path.join(n.state, FILE_NAME)) as stream:
                assert json.load(stream)["boot_id"] == "boot-2"
            await n.kubelet.restart(wipe_sockets=True)  # the kubelet starts after the boot
            await n.kubelet.wait_registered(DRIVER)
            other = str(uuid.uuid4())
            n.claim(["gpu1"], other, name="after-reboot")
            [again] = await n.kubelet.prepare(other, [("default", "after-reboot")])
            assert again.prepared

    run(body())


@pytest.mark.parametrize("damage", ["garbage", "binary", "directory", "wrong-shape"])
def test_a_damaged_checkpoint_is_moved_aside_with_one_error_line(short_dir, run, kube_api,
                                                                 caplog, damage):
    async def body():
        n = Node(short_dir, kube_api, _driver())
        kube_api.add_node(NODE)
        os.makedirs(n.state, exist_ok=True)
        path = os.path.join(n.state, FILE_NAME)
        if damage == "directory":
            os.makedirs(path)
        else:
            content = {"garbage": b'{"version": 1, "claims": [{"uid"',
                       "binary": b"\xff\xfe\x00\x01",
                       "wrong-shape": b'{"version": 1, "claims": {"a": 1}}'}[damage]
            with open(path, "wb") as stream:
                stream.write(content)
        with caplog.at_level("INFO"):
            await n.start_host()
        try:
            errors = [r for r in caplog.records if r.levelname == "ERROR"]
            assert len(errors) == 1 and errors[0].exc_info is None
            message = errors[0].getMessage()
            assert "\n" not in message and "is damaged or unreadable" in message
            assert "moved to" in message and "starting with no prepared claims" in message
            assert [f for f in os.listdir(n.state) if f.startswith(FILE_NAME + ".corrupt-")]
            assert n.front.checkpoint.claims == {}
            await n.start_kubelet()  # and it serves
            pod = str(uuid.uuid4())
            n.claim(["gpu0"], pod)
            [info] = await n.kubelet.prepare(pod, [("default", "claim-1")])
            assert info.prepared
            with open(path) as stream:
                assert json.load(stream)["claims"][0]["uid"] == info.uid
        finally:
            if n.kubelet is not None:
                await n.kubelet.stop()
            await n.stop_host()

    run(body())


def _env_names_exactly_its_devices(seen):
    for name, container in seen.items():
        visible = container.environ()["VISIBLE"].split(",")
        assert sorted(f"/dev/{d}" for d in visible) == container.device_paths(), name


def test_a_container_with_two_claims_is_told_all_its_devices(short_dir, run, kube_api):
    """The kubelet applies a container's claims one after the other and CDI keeps the last
    value of a variable: every request entry a container receives carries the union of what
    the container gets from the driver, so whichever comes last names all of them."""
    async def body():
        async with node(short_dir, kube_api, _driver(4)) as n:
            refs = {"both": [("pair", "a"), ("more", "")], "other": [("pair", "b")],
                    "more-first": [("more", ""), ("pair", "a")]}
            pod = n.pod("pod-a", ["pair", "more"], refs)
            n.claim_of({"a": ["gpu0"], "b": ["gpu1"]}, pod, name="pair")
            n.claim_of({"gpu": ["gpu2", "gpu3"]}, pod, name="more")
            pair, more = await n.kubelet.prepare(pod, [("default", "pair"),
                                                       ("default", "more")])
            seen = _containers(n, [("pair", pair), ("more", more)], refs)
            assert seen["both"].environ() == {"VISIBLE": "gpu0,gpu2,gpu3"}
            assert seen["more-first"].environ() == {"VISIBLE": "gpu0,gpu2,gpu3"}
            assert seen["other"].environ() == {"VISIBLE": "gpu1"}
            _env_names_exactly_its_devices(seen)
            assert n.front.services[DRIVER].env_fallbacks == 0

    run(body())


def test_a_two_request_claim_used_whole_or_split_names_exactly_each_containers_devices(
        short_dir, run, kube_api):
    async def body():
        async with node(short_dir, kube_api, _driver(6)) as n:
            whole = {"all": [("whole", "")]}
            pod = n.pod("pod-whole", ["whole"], whole)
            n.claim_of({"train": ["gpu0", "gpu2"], "serve": ["gpu1"]}, pod, name="whole",
                       pod_name="pod-whole")
            [info] = await n.kubelet.prepare(pod, [("default", "whole")])
            seen = _containers(n, [("whole", info)], whole)
            assert seen["all"].environ() == {"VISIBLE": "gpu0,gpu2,gpu1"}
            _env_names_exactly_its_devices(seen)

            split = {"trainer": [("split", "train")], "server": [("split", "serve")]}
            pod = n.pod("pod-split", ["split"], split)
            n.claim_of({"train": ["gpu3", "gpu5"], "serve": ["gpu4"]}, pod, name="split",
                       pod_name="pod-split")
            [info] = await n.kubelet.prepare(pod, [("default", "split")])
            seen = _containers(n, [("split", info)], split)
            assert seen["trainer"].environ() == {"VISIBLE": "gpu3,gpu5"}
            assert seen["server"].environ() == {"VISIBLE": "gpu4"}
            _env_names_exactly_its_devices(seen)
            assert n.front.services[DRIVER].env_fallbacks == 0

    run(body())


def test_a_shared_claim_with_different_partners_keeps_its_own_env_and_warns(
        short_dir, run, kube_api, caplog):
    """A claim two containers share, each with another claim of its own: no one value of its
    entry is right for both, so it names its own devices (one warning, counted); the partners'
    entries still carry each container's union, and no container is told about a device it
    did not receive."""
    async def body():
        async with node(short_dir, kube_api, _driver(4)) as n:
            refs = {"x": [("shared", ""), ("p1", "")], "y": [("shared", ""), ("p2", "")]}
            pod = n.pod("pod-a", ["p1", "p2", "shared"], refs)
            n.claim_of({"gpu": ["gpu0"]}, pod, name="shared")
            n.claim_of({"gpu": ["gpu1"]}, pod, name="p1")
            n.claim_of({"gpu": ["gpu2"]}, pod, name="p2")
            with caplog.at_level("WARNING", logger="host.dra.service"):
                infos = await n.kubelet.prepare(pod, [("default", c)
                                                      for c in ("p1", "p2", "shared")])
            warned = [r.getMessage() for r in caplog.records
                      if "lists only that request's devices" in r.getMessage()]
            assert len(warned) == 1 and "default/shared" in warned[0], warned
            assert "receive different devices" in warned[0]
            assert n.front.services[DRIVER].env_fallbacks == 1
            seen = _containers(n, list(zip(("p1", "p2", "shared"), infos)), refs)
            # The shared claim comes last in the pod: its own value is what stays.
            assert seen["x"].environ() == {"VISIBLE": "gpu0"}
            assert seen["y"].environ() == {"VISIBLE": "gpu0"}
            for container in seen.values():
                visible = set(container.environ()["VISIBLE"].split(","))
                assert {f"/dev/{d}" for d in visible} <= set(container.device_paths())

    run(body())
