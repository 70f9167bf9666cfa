"""The real kube-scheduler (KUBEBUILDER_ASSETS) against our slices with shared counters: a GPU
allocated whole keeps its MIG devices from being allocated after it went into MIG mode, a GPU
in MIG mode is never allocated whole, and a MIG device of a GPU nobody holds is allocated.

The control plane is etcd + kube-apiserver (host.sim.apiserver.RealApiServer) and
kube-scheduler, with a Node made by hand (no kubelet): the scheduler allocates claims and
binds pods, which is all this checks. Skipped without the binaries."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

import pytest
import yaml

from host.core.model import Device
from host.dra.kube import KubeClient
from host.dra.naming import dra_device_name, driver_name, pool_name
from host.dra.publisher import SlicePublisher
from host.sim.apiserver import RealApiServer, kubebuilder_assets

NODE = "gpu-node-1"
DRIVER = driver_name("nvidia.com/gpu", None, "gpu")
POOL = pool_name("nvidia.com/gpu", NODE)
GPU0, GPU1 = "0000:18:00.0", "0000:2a:00.0"
CLASSES = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes" / "overlays" / "dra" / \
    "deviceclass.yaml"
NAMESPACE = "default"
CLAIMS = f"/apis/resource.k8s.io/v1/namespaces/{NAMESPACE}/resourceclaims"
PODS = f"/api/v1/namespaces/{NAMESPACE}/pods"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def control_plane() -> Iterator[RealApiServer]:
    assets = kubebuilder_assets()
    if not assets or not os.path.exists(os.path.join(assets, "kube-scheduler")):
        pytest.skip("needs KUBEBUILDER_ASSETS with kube-scheduler (see ../shared/k8s/README.md)")
    with RealApiServer(assets) as api, open(os.path.join(
            os.path.dirname(api.kubeconfig_path), "kube-scheduler.log"), "ab") as log:
        kubeconfig = api.kubeconfig_path
        scheduler = subprocess.Popen(
            [os.path.join(assets, "kube-scheduler"), "--kubeconfig", kubeconfig,
             "--authentication-kubeconfig", kubeconfig, "--authorization-kubeconfig", kubeconfig,
             "--leader-elect=false", "--bind-address=127.0.0.1",
             f"--secure-port={_free_port()}"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            _make_node(api)
            classes = [c for c in yaml.safe_load_all(CLASSES.read_text(encoding="utf-8")) if c]
            # And a class of every device of the driver, as an operator's own class may be.
            classes.append({"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
                            "metadata": {"name": "any-device"}, "spec": {"selectors": [
                                {"cel": {"expression": f'device.driver == "{DRIVER}"'}}]}})
            for device_class in classes:
                _ok(api._request("POST", "/apis/resource.k8s.io/v1/deviceclasses",
                                 device_class))
            yield api
        finally:
            scheduler.terminate()
            try:
                scheduler.wait(10)
            except subprocess.TimeoutExpired:
                scheduler.kill()
                scheduler.wait(5)


def _ok(answer: Any) -> Dict[str, Any]:
    status, body = answer
    assert status < 300, body
    return body


def _make_node(api: RealApiServer) -> None:
    node = _ok(api._request("POST", "/api/v1/nodes", {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": NODE, "labels": {"kubernetes.io/hostname": NODE}}}))
    node["spec"]["taints"] = []  # admission adds not-ready; only a kubelet would clear it
    node = _ok(api._request("PUT", f"/api/v1/nodes/{NODE}", node))
    resources = {"cpu": "8", "memory": "32Gi", "pods": "110"}
    node["status"] = {"capacity": resources, "allocatable": resources, "conditions": [{
        "type": "Ready", "status": "True", "reason": "KubeletReady", "message": "test node",
        "lastHeartbeatTime": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "lastTransitionTime": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}]}
    _ok(api._request("PUT", f"/api/v1/nodes/{NODE}/status", node))


def _whole(address: str, partitioned: bool = False) -> Device:
    attributes = {"pci_address": address, "type": "gpu", "gpu_vendor": "nvidia"}
    if partitioned:
        attributes["partitioned"] = "true"
    return Device(id=address, attributes=attributes)


def _mig(parent: str, gi: int) -> Device:
    return Device(id=f"{parent}-gi{gi}-ci0", attributes={
        "pci_address": parent, "type": "mig", "parent": parent, "mig_gi": str(gi),
        "mig_ci": "0", "profile": "3g.40gb"})


def _publish(api: RealApiServer, publisher_run: Any, devices: List[Device]) -> None:
    async def body() -> None:
        client = KubeClient.from_settings(api.kubeconfig_path, timeout_s=5)
        publisher = SlicePublisher(client, NODE)
        publisher.set_pool(DRIVER, POOL, devices)
        await publisher.start()
        try:
            assert await publisher.wait_synced(30)
        finally:
            await publisher.stop()
            await client.close()

    publisher_run(body())


def _claim_and_pod(api: RealApiServer, name: str, device_class: str,
                   selector: Optional[str] = None, tolerate: bool = False) -> None:
    request: Dict[str, Any] = {"name": "gpu", "exactly": {"deviceClassName": device_class}}
    if selector:
        request["exactly"]["selectors"] = [{"cel": {"expression": selector}}]
    if tolerate:
        request["exactly"]["tolerations"] = [{"operator": "Exists", "effect": "NoSchedule"}]
    _ok(api._request("POST", CLAIMS, {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": name}, "spec": {"devices": {"requests": [request]}}}))
    _ok(api._request("POST", PODS, {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
        "spec": {"containers": [{"name": "c", "image": "busybox",
                                 "resources": {"claims": [{"name": "gpu"}]}}],
                 "resourceClaims": [{"name": "gpu", "resourceClaimName": name}]}}))


def _allocated(api: RealApiServer, name: str) -> List[str]:
    claim = _ok(api._request("GET", f"{CLAIMS}/{name}"))
    results = (((claim.get("status") or {}).get("allocation") or {}).get("devices") or {}).get(
        "results") or []
    return [r["device"] for r in results]


def _unschedulable(api: RealApiServer, name: str) -> Optional[str]:
    pod = _ok(api._request("GET", f"{PODS}/{name}"))
    for condition in (pod.get("status") or {}).get("conditions") or []:
        if condition["type"] == "PodScheduled" and condition["status"] == "False":
            return str(condition.get("message") or condition.get("reason"))
    return None


def _wait(predicate: Any, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)  # the scheduler runs in another process: nothing to wait on but it
    return False


def test_a_gpu_and_its_mig_devices_are_never_allocated_together(control_plane, run):
    api = control_plane
    mig_class = f"mig-3g.40gb.{DRIVER}"
    parent_is = 'device.attributes["' + DRIVER + '"].parent == "{}"'
    # A whole GPU, not partitioned: allocated to pod "whole".
    _publish(api, run, [_whole(GPU0)])
    _claim_and_pod(api, "whole", DRIVER)
    assert _wait(lambda: _allocated(api, "whole")), _unschedulable(api, "whole")
    assert _allocated(api, "whole") == [dra_device_name(GPU0)]

    # Both GPUs go into MIG mode: the pool now holds the partitioned GPUs and their MIG
    # devices, with counters. The whole GPU stays allocated (its pod keeps running).
    _publish(api, run, [_whole(GPU0, partitioned=True), _mig(GPU0, 1), _mig(GPU0, 2),
                        _whole(GPU1, partitioned=True), _mig(GPU1, 1)])
    _claim_and_pod(api, "mig-of-held-gpu", mig_class, parent_is.format(GPU0))
    _claim_and_pod(api, "mig-of-free-gpu", mig_class, parent_is.format(GPU1))
    _claim_and_pod(api, "another-whole", DRIVER)

    # A MIG device of the GPU nobody holds is allocated: counters do not block partitions.
    assert _wait(lambda: _allocated(api, "mig-of-free-gpu")), \
        _unschedulable(api, "mig-of-free-gpu")
    assert _allocated(api, "mig-of-free-gpu") == [dra_device_name(f"{GPU1}-gi1-ci0")]
    # The MIG devices of the GPU allocated whole are not; nor is a GPU in MIG mode, whole.
    for name in ("mig-of-held-gpu", "another-whole"):
        assert _wait(lambda name=name: _unschedulable(api, name) is not None), name
        assert _allocated(api, name) == [], name
    # A claim that tolerates the partitioned taint, through a class of every device, for the
    # GPU whose MIG device is allocated: the counters refuse it too.
    _claim_and_pod(api, "tolerating-parent", "any-device",
                   f'device.attributes["{DRIVER}"].pci_address == "{GPU1}" && '
                   f'device.attributes["{DRIVER}"].type == "gpu"', tolerate=True)
    assert _wait(lambda: _unschedulable(api, "tolerating-parent") is not None)
    time.sleep(2)  # and they stay so through the scheduler's retries
    for name in ("mig-of-held-gpu", "another-whole", "tolerating-parent"):
        assert _allocated(api, name) == [], name
