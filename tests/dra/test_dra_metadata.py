"""Device metadata (KEP-5304, ``[host] dra_device_metadata``): per request of a prepared claim, a
JSON file of its devices' attributes, bind-mounted by CDI where upstream's kubelet plugin
helper mounts it; off by default; removed on unprepare.

The API server is the stand-in or the real one (``kube_api``); the kubelet is the DRA
simulator over real sockets; containers are what testkit/device_plugin_host_testing/cdi_runtime
injects.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import uuid
from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest

from device_plugin_host_testing.cdi_runtime import CdiCache, container_cdi_ids
from device_plugin_host_testing.drivers import MemoryDriver
from host.config import parse_config
from host.config.errors import ConfigError
from host.core.hostfs import HostFS
from host.core.isolation import DriverCalls
from host.core.model import Device, DeviceNode, ResourceConfig
from host.dra import metadata, naming
from host.dra.frontend import DraFrontEnd
from host.dra.kube import KubeClient
from host.sim.apiserver import kube_api
from host.sim.kubelet_dra import DraKubeletSimulator

__all__ = ["kube_api"]

NODE = "node-1"
RESOURCE = ResourceConfig(name="example.com/gpu", driver="memory", api="dra")
DRIVER = naming.driver_name(RESOURCE.name, None)
POOL = naming.pool_name(RESOURCE.name, NODE)


def gpu(i: int) -> Device:
    address = f"0000:{0x10 + i:02x}:00.0"
    return Device(id=f"gpu{i}", device_nodes=(DeviceNode(f"/dev/gpu{i}"),),
                  env={"VISIBLE": f"gpu{i}"}, numa_nodes=(i % 2,),
                  attributes={"pci_address": address, "model": "Example 9000"})


class Node:
    def __init__(self, root: str, api: Any) -> None:
        self.root, self.api = root, api
        self.driver = MemoryDriver(devices={RESOURCE.name: [gpu(i) for i in range(3)]})
        self.registry = os.path.join(root, "registry")
        self.plugins = os.path.join(root, "plugins")
        self.cdi = os.path.join(root, "cdi")
        self.data = os.path.join(self.plugins, DRIVER)
        self.version = "v1alpha1"

    async def start(self) -> None:
        self.calls = DriverCalls()
        self.client = KubeClient.from_settings(self.api.kubeconfig_path)
        self.front = DraFrontEnd(node_name=NODE, claims=self.client, calls=self.calls,
                                 registry_dir=self.registry, plugins_dir=self.plugins,
                                 state_dir=os.path.join(self.root, "state"), cdi_dir=self.cdi,
                                 allocate_timeout_s=2,
                                 host=HostFS(os.path.join(self.root, "hostroot")))
        self.front.device_metadata = lambda: self.version
        self.front.sync(RESOURCE, self.driver, self.driver.devices[RESOURCE.name])
        self.kubelet = DraKubeletSimulator(
            self.registry, node_name=NODE, plugins_dir=self.plugins,
            get_claim=lambda ns, c: self.client.get_resource_claim(ns, c))
        await self.kubelet.start()
        await self.kubelet.wait_registered(DRIVER)

    async def stop(self) -> None:
        await self.kubelet.stop()
        await self.front.close()
        await self.client.close()
        self.calls.shutdown()

    def claim(self, name: str, pod: str, requests: Dict[str, List[str]],
              pod_claim: Optional[str] = None) -> Dict[str, Any]:
        meta: Dict[str, Any] = {"name": name, "namespace": "default"}
        if pod_claim:
            meta["annotations"] = {metadata.POD_CLAIM_ANNOTATION: pod_claim}
        return self.api.put_resource_claim({  # type: ignore[no-any-return]
            "metadata": meta,
            "spec": {"devices": {"requests": [_spec_request(r) for r in requests]}},
            "status": {"allocation": {"devices": {"results": [
                {"request": r, "driver": DRIVER, "pool": POOL, "device": d}
                for r, devices in requests.items() for d in devices]}},
                "reservedFor": [{"resource": "pods", "name": "p", "uid": pod}]}})


def _spec_request(request: str) -> Dict[str, Any]:
    """``gpu``, or ``serve/small``: a request with a first-available subrequest."""
    base, _, sub = request.partition("/")
    if sub:
        return {"name": base, "firstAvailable": [{"name": sub, "deviceClassName": "gpu"}]}
    return {"name": base, "exactly": {"deviceClassName": "gpu"}}


@contextlib.asynccontextmanager
async def node(root: str, api: Any):
    api.add_node(NODE)
    n = Node(root, api)
    await n.start()
    try:
        yield n
    finally:
        await n.stop()


def _stream(path: str) -> List[Dict[str, Any]]:
    """The file as upstream's decoder reads it: JSON objects one after another."""
    decoder, text, out, at = json.JSONDecoder(), Path(path).read_text(), [], 0
    while text[at:].strip():
        while text[at].isspace():
            at += 1
        obj, at = decoder.raw_decode(text, at)
        out.append(obj)
    return out


def test_each_request_gets_its_metadata_file_mounted_where_upstream_mounts_it(short_dir, run,
                                                                            kube_api):
    async def body():
        async with node(short_dir, kube_api) as n:
            pod = str(uuid.uuid4())
            claim = n.claim("gpus", pod, {"train": ["gpu0", "gpu1"], "serve/small": ["gpu2"]})
            uid = claim["metadata"]["uid"]
            [info] = await n.kubelet.prepare(pod, [("default", "gpus")])
            train = metadata.file_path(n.data, "default", "gpus", "train")
            serve = metadata.file_path(n.data, "default", "gpus", "serve")
            [doc] = _stream(train)
            assert doc["apiVersion"] == "metadata.resource.k8s.io/v1alpha1"
            assert doc["kind"] == "DeviceMetadata"
            assert doc["metadata"] == {"name": "gpus", "namespace": "default", "uid": uid,
                                       "generation": 1}
            assert "podClaimName" not in doc
            [request] = doc["requests"]
            assert request["name"] == "train"
            assert [(d["driver"], d["pool"], d["name"]) for d in request["devices"]] == [
                (DRIVER, POOL, "gpu0"), (DRIVER, POOL, "gpu1")]
            attributes = request["devices"][1]["attributes"]
            assert attributes["resource.kubernetes.io/pciBusID"] == {"string": "0000:11:00.0"}
            assert attributes["model"] == {"string": "Example 9000"}
            assert _stream(serve)[0]["requests"][0]["name"] == "serve/small"
            # root-written: files 0644, directories 0755, none a symlink
            assert stat.S_IMODE(os.lstat(train).st_mode) == 0o644
            assert stat.S_IMODE(os.lstat(os.path.dirname(train)).st_mode) == 0o755
            spec = metadata.spec_path(n.cdi, DRIVER, uid, "train")
            assert stat.S_IMODE(os.lstat(spec).st_mode) == 0o644
            # a container of the train request gets its file, read-only, at upstream's path
            cache = CdiCache(n.cdi)
            assert cache.errors == {}
            for request_name, path in (("train", train), ("serve", serve)):
                ids = container_cdi_ids([("gpus", info)], [("gpus", request_name)])
                assert f"{DRIVER}/metadata={uid}_{request_name}" in ids
                [mount] = cache.inject(ids).mounts
                assert mount == {"hostPath": path, "options": ["ro", "bind"],
                                 "containerPath": "/var/run/kubernetes.io/dra-device-attributes"
                                 f"/resourceclaims/gpus/{request_name}/{DRIVER}-metadata.json"}
            await n.kubelet.unprepare(pod)
            assert not os.path.exists(metadata.claim_dir(n.data, "default", "gpus"))
            assert not os.path.exists(spec)

    run(body())


def test_a_claim_from_a_template_is_mounted_under_its_pod_claim_name(short_dir, run, kube_api):
    async def body():
        async with node(short_dir, kube_api) as n:
            pod = str(uuid.uuid4())
            n.claim("pod-a-gpu-x7k2q", pod, {"gpu": ["gpu0"]}, pod_claim="gpu")
            [info] = await n.kubelet.prepare(pod, [("default", "pod-a-gpu-x7k2q")])
            [mount] = CdiCache(n.cdi).inject(info.cdi_devices()).mounts
            assert mount["containerPath"] == ("/var/run/kubernetes.io/dra-device-attributes/"
                                              f"resourceclaimtemplates/gpu/gpu/{DRIVER}"
                                              "-metadata.json")
            [doc] = _stream(mount["hostPath"])
            assert doc["podClaimName"] == "gpu"

    run(body())


def test_off_writes_nothing(short_dir, run, kube_api):
    async def body():
        async with node(short_dir, kube_api) as n:
            n.version = "off"
            pod = str(uuid.uuid4())
            n.claim("gpus", pod, {"gpu": ["gpu0"]})
            [info] = await n.kubelet.prepare(pod, [("default", "gpus")])
            assert not os.path.exists(os.path.join(n.data, metadata.SUB_DIR))
            assert not any("/metadata=" in i for i in info.cdi_devices())
            assert not [f for f in os.listdir(n.cdi) if "_metadata_" in f]

    run(body())


def test_a_symlink_planted_at_the_file_is_replaced_not_followed(short_dir, run, kube_api):
    async def body():
        async with node(short_dir, kube_api) as n:
            pod = str(uuid.uuid4())
            target = os.path.join(short_dir, "precious")
            with open(target, "w") as stream:
                stream.write("keep me\n")
            path = metadata.file_path(n.data, "default", "gpus", "gpu")
            os.makedirs(os.path.dirname(path))
            os.symlink(target, path)
            n.claim("gpus", pod, {"gpu": ["gpu0"]})
            await n.kubelet.prepare(pod, [("default", "gpus")])
            assert Path(target).read_text() == "keep me\n"
            assert not os.path.islink(path) and _stream(path)[0]["kind"] == "DeviceMetadata"

    run(body())


def test_the_config_key_is_validated_and_off_by_default():
    drivers = {"memory": MemoryDriver()}
    text = '[[resource]]\nname = "example.com/gpu"\ndriver = "memory"\n'
    assert parse_config(text, "f.toml", drivers).host.dra_device_metadata == "off"
    on = parse_config('[host]\ndra_device_metadata = "v1alpha1"\n' + text, "f.toml", drivers)
    assert on.host.dra_device_metadata == "v1alpha1"
    with pytest.raises(ConfigError, match=r"host\.dra_device_metadata"):
        parse_config('[host]\ndra_device_metadata = "yes"\n' + text, "f.toml", drivers)
