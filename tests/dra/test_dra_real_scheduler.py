"""The real kube-scheduler allocates from the slices our host publishes, and our host prepares
what it allocated.

One control plane for the module, per pytest-xdist worker that runs some of its tests
(KUBEBUILDER_ASSETS: etcd, kube-apiserver, kube-scheduler, kube-controller-manager, v1.36 or
newer, as ../shared/k8s/README.md describes): a Node made here (Ready, without the not-ready
taint, no kubelet), the DeviceClasses of the shipped ``dra`` overlay, and
``device-plugin-host run`` as a child process with the overlay's resources on a captured
8-GPU machine (4 GPUs on each NUMA node). The kubelet's DRA side is the simulator
(host/sim/kubelet_dra): its plugin watcher registers our driver, and it calls
NodePrepareResources over the real gRPC socket for the claims the scheduler allocated.

A scenario is a test that takes ``cluster`` (a fresh namespace each; its pods and claims are
deleted after it, so every test starts with all GPUs free): ``cluster.template(...)``,
``cluster.pod(...)`` (pinned to a Node, ``NODE`` by default), ``cluster.wait_allocated(pod)``
(the pod's claims, allocated), ``cluster.wait_unschedulable(pod, containing)`` and
``cluster.prepare(pod)`` (the prepare of the kubelet of the pod's Node). A scenario that
needs another machine or config adds a Node with its own host once, from a module fixture:
``control_plane.add_node(name, machine, resources_toml, drivers, published, **host_settings)``.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import pytest
import yaml

from device_plugin_host_testing.machines import load_machine
from host.dra import naming
from host.dra.kube import KubeClient
from host.sim.apiserver import RealApiServer, kubebuilder_assets
from host.sim.kubelet_dra import ClaimInfo, DraKubeletSimulator

REPO = Path(__file__).resolve().parents[2]
OVERLAY = REPO / "deploy" / "kubernetes" / "overlays" / "dra"
MACHINE = "gpu-server-8x"  # 8 H100s: 4 on NUMA node 0, 4 on NUMA node 1
GPUS = 8
NODE = "dra-node-1"
RESOURCE = "nvidia.com/gpu"
DRIVER = naming.driver_name(RESOURCE, None)
POOL = naming.pool_name(RESOURCE, NODE)
NUMA = "resource.kubernetes.io/numaNode"
# ../shared/k8s/README.md: the same set for the scheduler and the controller manager.
GATES = ("DRAPartitionableDevices=true,DRAConsumableCapacity=true,DRADeviceTaints=true,"
         "DRAExtendedResource=true,DRADeviceBindingConditions=true,ResourceHealthStatus=true")
WAIT_S = 30.0


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Api:
    """Plain JSON requests to the API server with the admin token."""

    def __init__(self, server: RealApiServer) -> None:
        self.port = server.port
        self.token = server.TOKEN
        self._ctx = ssl.create_default_context(cafile=server.ca_path)
        self._ctx.check_hostname = False  # the certificate names 127.0.0.1 as an IP SAN

    def request(self, method: str, path: str, body: Any = None,
                ok: Sequence[int] = (200, 201, 202)) -> Any:
        conn = http.client.HTTPSConnection("127.0.0.1", self.port, context=self._ctx,
                                           timeout=10)
        try:
            conn.request(method, path, body=None if body is None else json.dumps(body),
                         headers={"Authorization": f"Bearer {self.token}",
                                  "Content-Type": "application/json",
                                  "Accept": "application/json"})
            response = conn.getresponse()
            data = json.loads(response.read() or b"null")
        finally:
            conn.close()
        if response.status not in ok:
            raise AssertionError(f"{method} {path}: {response.status} {data}")
        return data

    def get(self, path: str) -> Any:
        return self.request("GET", path)

    def create(self, path: str, obj: Dict[str, Any]) -> Dict[str, Any]:
        return self.request("POST", path, obj)  # type: ignore[no-any-return]


def _until(what: str, probe: Any, timeout: float = WAIT_S, every: float = 0.1) -> Any:
    """Poll ``probe()`` until it returns something true (the API server has no hook here)."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what}: not within {timeout:.0f} s")
        time.sleep(every)


class _Process:
    def __init__(self, name: str, args: List[str], log_dir: str,
                 env: Optional[Dict[str, str]] = None) -> None:
        self.name = name
        self.log_path = os.path.join(log_dir, f"{name}.log")
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         cwd=REPO, start_new_session=True)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(Path(self.log_path).read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)


def _healthy(port: int) -> bool:
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE  # a self-signed serving certificate made at start
    conn = http.client.HTTPSConnection("127.0.0.1", port, context=ctx, timeout=2)
    try:
        conn.request("GET", "/healthz")
        response = conn.getresponse()
        return response.status == 200 and response.read() == b"ok"
    except OSError:
        return False
    finally:
        conn.close()


def _control_plane_component(name: str, assets: str, server: RealApiServer, work: str,
                             extra: List[str]) -> _Process:
    port = _free_port()
    kubeconfig = server.kubeconfig_path
    process = _Process(name, [
        os.path.join(assets, name), "--kubeconfig", kubeconfig,
        "--authentication-kubeconfig", kubeconfig, "--authorization-kubeconfig", kubeconfig,
        "--leader-elect=false", "--bind-address=127.0.0.1", f"--secure-port={port}",
        f"--feature-gates={GATES}", *extra], work)
    deadline = time.monotonic() + 60
    while not _healthy(port):
        if not process.alive():
            raise RuntimeError(f"{name} exited:\n{process.log_tail()}")
        if time.monotonic() >= deadline:
            process.stop()
            raise RuntimeError(f"{name} not healthy in 60 s:\n{process.log_tail()}")
        time.sleep(0.2)  # a child process start-up: nothing to wait on but its port
    return process


def _make_node(api: Api, name: str) -> None:
    """A Node as a kubelet would register it, Ready, without the not-ready taint that
    admission adds (only the node-lifecycle controller, not run here, would remove it)."""
    api.create("/api/v1/nodes", {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name,
                                              "kubernetes.io/os": "linux"}}})
    capacity = {"cpu": "64", "memory": "256Gi", "pods": "110"}

    def ready(node: Dict[str, Any]) -> None:
        node["status"] = {"capacity": capacity, "allocatable": capacity, "conditions": [{
            "type": "Ready", "status": "True", "reason": "KubeletReady",
            "message": "no kubelet: a test node", "lastHeartbeatTime": _now(),
            "lastTransitionTime": _now()}]}

    def untainted(node: Dict[str, Any]) -> None:
        node["spec"]["taints"] = []

    _update(api, f"/api/v1/nodes/{name}/status", ready)
    _update(api, f"/api/v1/nodes/{name}", untainted)


def _update(api: Api, path: str, change: Any) -> Dict[str, Any]:
    """Read, change, write; again on a 409 (the controller manager's TTL controller
    annotates a new Node meanwhile), as client-go's RetryOnConflict does."""
    for _ in range(10):
        obj = api.get(path)
        change(obj)
        written = api.request("PUT", path, obj, ok=(200, 409))
        if written.get("kind") != "Status":
            return written  # type: ignore[no-any-return]
    raise AssertionError(f"PUT {path}: still 409 after 10 tries")


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def overlay_device_classes() -> List[Dict[str, Any]]:
    """Every DeviceClass among the overlay's own resources (its kustomization.yaml)."""
    kustomization = yaml.safe_load((OVERLAY / "kustomization.yaml").read_text())
    classes = []
    for entry in kustomization.get("resources") or []:
        path = OVERLAY / entry
        if not path.is_file():
            continue  # ../../base and other directories: no DeviceClass there
        for doc in yaml.safe_load_all(path.read_text()):
            if isinstance(doc, dict) and doc.get("kind") == "DeviceClass":
                classes.append(doc)
    return classes


def overlay_resources() -> str:
    """The ``[[resource]]`` tables of the overlay's config.toml, as shipped."""
    shipped = (OVERLAY / "config.toml").read_text()
    return shipped[shipped.index("[[resource]]"):]


def _host_config(work: str, server: RealApiServer, node: str, resources: str,
                 settings: Dict[str, Any]) -> str:
    """``resources`` (TOML) with [host] paths of this test and ``settings``."""
    host = {
        "node_name": node, "kubeconfig": server.kubeconfig_path, "metrics_address": "",
        "plugins_registry_dir": os.path.join(work, "registry"),
        "dra_plugins_dir": os.path.join(work, "plugins"),
        "dra_state_dir": os.path.join(work, "state"), "cdi_dir": os.path.join(work, "cdi"),
        "drain_file": os.path.join(work, "drain", "drained"), "nfd_features_file": "",
        "pod_resources_socket": os.path.join(work, "pod-resources", "kubelet.sock"),
        **settings,
    }
    path = os.path.join(work, "config.toml")
    with open(path, "w", encoding="utf-8") as handle:
        handle.write("[host]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in host.items())
                     + "\n" + resources)
    return path


class _Loop:
    """An event loop on its own thread for the kubelet simulator, which outlives a test."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="kubelet-dra",
                                        daemon=True)
        self._thread.start()

    def run(self, coro: Any, timeout: float = WAIT_S) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


class NodeHost:
    """One Node: our host (``device-plugin-host run``) on a captured machine, and the
    kubelet's DRA side (the simulator) on the control plane's loop."""

    def __init__(self, name: str, work: str) -> None:
        self.name = name
        self.work = work
        self.cdi_dir = os.path.join(work, "cdi")
        self.host: Optional[_Process] = None
        self.kubelet: Optional[DraKubeletSimulator] = None

    def alive(self) -> bool:
        assert self.host is not None
        if not self.host.alive():
            raise AssertionError(f"device-plugin-host on {self.name} exited:\n"
                                 f"{self.host.log_tail()}")
        return True

    def cdi_ids_on_disk(self) -> Dict[str, Dict[str, Any]]:
        """Every CDI device the specs in the host's CDI directory define, by qualified id."""
        out = {}
        for path in Path(self.cdi_dir).glob("*.json"):
            spec = json.loads(path.read_text())
            for device in spec.get("devices") or ():
                out[f"{spec['kind']}={device['name']}"] = device
        return out


class ControlPlane:
    """The module's cluster: API server, scheduler, controller manager, the overlay's
    DeviceClasses, and its Nodes (``add_node``), each with our host."""

    def __init__(self, assets: str, work: str) -> None:
        self.assets = assets
        self.work = work
        self.server = RealApiServer(assets, device_taints=True)
        self.processes: List[_Process] = []
        self.api: Optional[Api] = None
        self.loop: Optional[_Loop] = None
        self.client: Optional[KubeClient] = None
        self.nodes: Dict[str, NodeHost] = {}

    def start(self) -> None:
        self.server.start()
        self.api = Api(self.server)
        certs = os.path.dirname(self.server.ca_path)
        self.processes.append(_control_plane_component(
            "kube-scheduler", self.assets, self.server, self.work, []))
        self.processes.append(_control_plane_component(
            "kube-controller-manager", self.assets, self.server, self.work, [
                "--controllers=*,-node-lifecycle-controller",
                f"--service-account-private-key-file={os.path.join(certs, 'sa.key')}",
                f"--root-ca-file={self.server.ca_path}",
                "--use-service-account-credentials=false"]))
        for device_class in overlay_device_classes():
            self.api.create("/apis/resource.k8s.io/v1/deviceclasses", device_class)
        self.loop = _Loop()
        self.client = self.loop.run(self._client())
        self.add_node(NODE, MACHINE, overlay_resources(), [DRIVER],
                      lambda server: len(server.devices(DRIVER, NODE)) == GPUS)

    async def _client(self) -> KubeClient:
        return KubeClient.from_settings(self.server.kubeconfig_path)

    def add_node(self, name: str, machine: str, resources: str, drivers: Sequence[str],
                 published: Any, **settings: Any) -> NodeHost:
        """A Node ``name`` whose host serves ``resources`` (TOML ``[[resource]]`` tables)
        on the captured ``machine`` with [host] ``settings``; returns once the kubelet has
        registered ``drivers`` and ``published(server)`` holds."""
        assert self.api is not None and self.loop is not None
        node = NodeHost(name, os.path.join(self.work, name))
        os.makedirs(node.work)
        self.nodes[name] = node
        _make_node(self.api, name)
        tree = os.path.join(node.work, "root")
        load_machine(machine, tree)
        config = _host_config(node.work, self.server, name, resources, settings)
        node.host = _Process("device-plugin-host", [
            sys.executable, "-m", "host", "run", "--config", config,
            "--plugin-dir", os.path.join(node.work, "dp"), "--host-root", tree], node.work)
        node.kubelet = self.loop.run(self._kubelet(node, drivers))
        _until(f"slices of {name} published", lambda: node.alive() and published(self.server))
        return node

    async def _kubelet(self, node: NodeHost, drivers: Sequence[str]) -> DraKubeletSimulator:
        assert self.client is not None
        kubelet = DraKubeletSimulator(
            os.path.join(node.work, "registry"), get_claim=self.client.get_resource_claim,
            node_name=node.name, plugins_dir=os.path.join(node.work, "plugins"))
        await kubelet.start()
        await kubelet.wait_registered(*drivers)
        return kubelet

    def close(self) -> None:
        if self.loop is not None:
            async def stop() -> None:
                for node in self.nodes.values():
                    if node.kubelet is not None:
                        await node.kubelet.stop()
                if self.client is not None:
                    await self.client.close()
            try:
                self.loop.run(stop())
            finally:
                self.loop.close()
        for process in [*(n.host for n in self.nodes.values()), *reversed(self.processes)]:
            if process is not None:
                process.stop()
        self.server.close()


class Cluster:
    """One test's view: its own namespace, and the helpers a scenario is written with."""

    def __init__(self, plane: ControlPlane, namespace: str) -> None:
        self.plane = plane
        self.namespace = namespace
        assert plane.api is not None
        self.api = plane.api
        self.pods: Dict[str, str] = {}  # name -> uid
        self._prepared: List[Tuple[str, str]] = []  # (node, pod uid), for the unprepare

    @property
    def _ns(self) -> str:
        return f"/api/v1/namespaces/{self.namespace}"

    @property
    def _rs(self) -> str:
        return f"/apis/resource.k8s.io/v1/namespaces/{self.namespace}"

    def template(self, name: str, requests: List[Dict[str, Any]],
                 constraints: Optional[List[Dict[str, Any]]] = None) -> str:
        """A ResourceClaimTemplate; ``requests`` as in a claim's spec.devices.requests."""
        devices: Dict[str, Any] = {"requests": requests}
        if constraints:
            devices["constraints"] = constraints
        self.api.create(f"{self._rs}/resourceclaimtemplates", {
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
            "metadata": {"name": name}, "spec": {"spec": {"devices": devices}}})
        return name

    @staticmethod
    def gpus(count: int = 1, name: str = "gpus",
             device_class: str = DRIVER) -> Dict[str, Any]:
        """One request of ``count`` devices of a class (the overlay's class by default)."""
        return {"name": name, "exactly": {"deviceClassName": device_class, "count": count}}

    def pod(self, name: str, claims: Optional[Dict[str, str]] = None,
            limits: Optional[Dict[str, str]] = None, node: str = NODE) -> Dict[str, Any]:
        """A pod for Node ``node`` (a nodeSelector) whose one container uses ``claims``
        (pod claim name -> template name) and asks for ``limits`` (extended resources)."""
        container: Dict[str, Any] = {"name": "main", "image": "busybox",
                                     "command": ["sleep", "3600"], "resources": {}}
        spec: Dict[str, Any] = {"containers": [container], "terminationGracePeriodSeconds": 0,
                                "nodeSelector": {"kubernetes.io/hostname": node}}
        if claims:
            spec["resourceClaims"] = [{"name": k, "resourceClaimTemplateName": v}
                                      for k, v in claims.items()]
            container["resources"]["claims"] = [{"name": k} for k in claims]
        if limits:
            container["resources"]["limits"] = dict(limits)
        pod = self.api.create(f"{self._ns}/pods", {
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec})
        self.pods[name] = pod["metadata"]["uid"]
        return pod  # type: ignore[no-any-return]

    def get_pod(self, name: str) -> Dict[str, Any]:
        return self.api.get(f"{self._ns}/pods/{name}")  # type: ignore[no-any-return]

    def get_claim(self, name: str) -> Dict[str, Any]:
        return self.api.get(f"{self._rs}/resourceclaims/{name}")  # type: ignore[no-any-return]

    def claim_names(self, pod: Dict[str, Any]) -> List[str]:
        status = pod.get("status") or {}
        names = [s["resourceClaimName"] for s in status.get("resourceClaimStatuses") or ()
                 if s.get("resourceClaimName")]
        extended = (status.get("extendedResourceClaimStatus") or {}).get("resourceClaimName")
        return names + ([extended] if extended else [])

    def wait_allocated(self, name: str) -> List[Dict[str, Any]]:
        """The pod is bound to a Node; its claims (templated and extended-resource ones),
        each allocated and reserved for it."""
        def bound() -> Optional[List[Dict[str, Any]]]:
            for node in self.plane.nodes.values():
                node.alive()
            pod = self.get_pod(name)
            if not pod["spec"].get("nodeName"):
                return None
            claims = [self.get_claim(c) for c in self.claim_names(pod)]
            uid = pod["metadata"]["uid"]
            if claims and all((c.get("status") or {}).get("allocation") and uid in [
                    r.get("uid") for r in c["status"].get("reservedFor") or ()]
                    for c in claims):
                return claims
            return None

        return _until(f"pod {name} bound with its claims allocated", bound)  # type: ignore

    def wait_unschedulable(self, name: str, containing: str = "") -> str:
        """The scheduler's PodScheduled=False/Unschedulable message for the pod, once it
        contains ``containing`` (until the controller has made a pod's claims, the
        scheduler reports those missing instead)."""
        def condition() -> Optional[str]:
            pod = self.get_pod(name)
            assert not pod["spec"].get("nodeName"), f"pod {name} was bound"
            for c in (pod.get("status") or {}).get("conditions") or ():
                if c.get("type") == "PodScheduled" and c.get("reason") == "Unschedulable" \
                        and containing in str(c.get("message")):
                    return str(c.get("message"))
            return None

        return _until(f"pod {name} unschedulable ({containing!r})",  # type: ignore
                      condition)

    def prepare(self, name: str) -> List[ClaimInfo]:
        """What the kubelet of the pod's Node does for it: reads its claims and calls our
        NodePrepareResources over the plugin's socket."""
        pod = self.get_pod(name)
        claims = [(self.namespace, c) for c in self.claim_names(pod)]
        node = pod["spec"]["nodeName"]
        kubelet = self.plane.nodes[node].kubelet
        assert kubelet is not None and self.plane.loop is not None
        infos = self.plane.loop.run(kubelet.prepare(pod["metadata"]["uid"], claims))
        self._prepared.append((node, pod["metadata"]["uid"]))
        return infos  # type: ignore[no-any-return]

    def cdi_ids_on_disk(self, node: str = NODE) -> Dict[str, Dict[str, Any]]:
        return self.plane.nodes[node].cdi_ids_on_disk()

    def cleanup(self) -> None:
        """Unprepare, then delete the pods at once (no kubelet to wait for) and wait until
        the controller has deleted their claims: the devices are free for the next test."""
        loop = self.plane.loop
        assert loop is not None
        for node, uid in self._prepared:
            kubelet = self.plane.nodes[node].kubelet
            assert kubelet is not None
            loop.run(kubelet.unprepare(uid))
        for name in self.pods:
            self.api.request("DELETE", f"{self._ns}/pods/{name}?gracePeriodSeconds=0",
                             ok=(200, 202, 404))
        _until("the test's claims deleted", lambda: not self.api.get(
            f"{self._rs}/resourceclaims")["items"])


@pytest.fixture(scope="module")
def control_plane() -> Iterator[ControlPlane]:
    assets = kubebuilder_assets()
    if assets is None:
        pytest.skip("needs the real Kubernetes binaries: KUBEBUILDER_ASSETS naming a directory "
                    "with kube-apiserver, etcd, kube-scheduler and kube-controller-manager "
                    "(export KUBEBUILDER_ASSETS=$(../shared/k8s/unpack))")
    missing = [b for b in ("kube-scheduler", "kube-controller-manager")
               if not os.access(os.path.join(assets, b), os.X_OK)]
    if missing:
        pytest.skip(f"needs {' and '.join(missing)} beside kube-apiserver in {assets}")
    work = tempfile.mkdtemp(prefix="dph-k8s-", dir="/tmp")  # unix socket paths stay short
    plane = ControlPlane(assets, work)
    try:
        plane.start()
        yield plane
    finally:
        plane.close()
        shutil.rmtree(work, ignore_errors=True)


@pytest.fixture
def cluster(control_plane: ControlPlane) -> Iterator[Cluster]:
    namespace = f"t-{uuid.uuid4().hex[:8]}"
    assert control_plane.api is not None
    control_plane.api.create("/api/v1/namespaces", {
        "apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
    view = Cluster(control_plane, namespace)
    try:
        yield view
    finally:
        view.cleanup()


def _results(claim: Dict[str, Any]) -> List[Dict[str, Any]]:
    return list(claim["status"]["allocation"]["devices"]["results"])


def _published(plane: ControlPlane) -> Dict[str, Dict[str, Any]]:
    return plane.server.devices(DRIVER, NODE)


# -- scenarios ---------------------------------------------------------------------------------


def test_the_overlay_ships_the_device_class_the_scenarios_use(control_plane):
    assert DRIVER in [c["metadata"]["name"] for c in overlay_device_classes()]
    assert control_plane.api is not None
    served = control_plane.api.get(f"/apis/resource.k8s.io/v1/deviceclasses/{DRIVER}")
    assert served["spec"]["extendedResourceName"] == RESOURCE  # the gate kept the field


def test_a_one_gpu_claim_is_allocated_from_our_slice_and_prepared(cluster):
    cluster.template("one-gpu", [cluster.gpus(1)])
    cluster.pod("one", {"gpus": "one-gpu"})
    [claim] = cluster.wait_allocated("one")
    [result] = _results(claim)
    assert (result["driver"], result["pool"]) == (DRIVER, POOL)
    assert result["device"] in _published(cluster.plane)
    [info] = cluster.prepare("one")
    [device] = info.devices[DRIVER]
    assert device.device_name == result["device"] and device.pool_name == POOL
    on_disk = cluster.cdi_ids_on_disk()
    assert device.cdi_device_ids and all(i in on_disk for i in device.cdi_device_ids)


def test_four_gpus_with_match_attribute_come_from_one_numa_node(cluster):
    """One GPU of the first NUMA node is taken first: the allocator's first fit would then
    span both nodes, and only the constraint on our numaNode attribute keeps the 4 on one."""
    published = _published(cluster.plane)
    cluster.template("one-gpu", [cluster.gpus(1)])
    cluster.pod("one", {"gpus": "one-gpu"})
    [taken] = [r["device"] for c in cluster.wait_allocated("one") for r in _results(c)]
    cluster.template("four-gpus", [cluster.gpus(4)],
                     [{"requests": ["gpus"], "matchAttribute": NUMA}])
    cluster.pod("four", {"gpus": "four-gpus"})
    [claim] = cluster.wait_allocated("four")
    devices = [r["device"] for r in _results(claim)]
    assert len(set(devices)) == 4 and taken not in devices
    numa = {published[d]["attributes"][NUMA]["int"] for d in devices}
    assert numa == {1 - published[taken]["attributes"][NUMA]["int"]}, numa
    [info] = cluster.prepare("four")
    assert sorted(d.device_name for d in info.devices[DRIVER]) == sorted(devices)
    on_disk = cluster.cdi_ids_on_disk()
    assert all(i in on_disk for d in info.devices[DRIVER] for i in d.cdi_device_ids)


def test_an_extended_resource_request_is_served_through_the_device_class(cluster):
    """``nvidia.com/gpu: 1`` in a container's limits, no claim in the pod: the scheduler
    allocates it through the class's extendedResourceName (DRAExtendedResource)."""
    cluster.pod("legacy", limits={RESOURCE: "1"})
    [claim] = cluster.wait_allocated("legacy")
    [result] = _results(claim)
    assert (result["driver"], result["pool"]) == (DRIVER, POOL)
    pod = cluster.get_pod("legacy")
    assert pod["status"]["extendedResourceClaimStatus"]["resourceClaimName"] == \
        claim["metadata"]["name"]
    [info] = cluster.prepare("legacy")
    [device] = info.devices[DRIVER]
    assert device.device_name == result["device"]
    on_disk = cluster.cdi_ids_on_disk()
    assert device.cdi_device_ids and all(i in on_disk for i in device.cdi_device_ids)


def test_one_pod_more_than_there_are_gpus_stays_pending(cluster):
    cluster.template("one-gpu", [cluster.gpus(1)])
    names = [f"p{i}" for i in range(GPUS + 1)]
    for name in names:
        cluster.pod(name, {"gpus": "one-gpu"})

    def all_gpus_taken() -> Optional[List[str]]:
        bound = [n for n in names if cluster.get_pod(n)["spec"].get("nodeName")]
        assert len(bound) <= GPUS, bound
        return bound if len(bound) == GPUS else None

    bound = _until(f"{GPUS} pods bound", all_gpus_taken)
    [left] = set(names) - set(bound)
    devices = [r["device"] for p in bound for c in cluster.wait_allocated(p)
               for r in _results(c)]
    assert sorted(devices) == sorted(_published(cluster.plane))  # each GPU once
    message = cluster.wait_unschedulable(left, "cannot allocate all claims")
    assert "nodes are available" in message, message
    assert not cluster.get_pod(left)["spec"].get("nodeName")


@pytest.fixture(scope="module")
def second_node(control_plane: ControlPlane) -> NodeHost:
    """Another Node of the same kind, with its own host (how a scenario adds a machine)."""
    name = "dra-node-2"
    return control_plane.add_node(name, MACHINE, overlay_resources(), [DRIVER],
                                  lambda server: len(server.devices(DRIVER, name)) == GPUS)


def test_a_claim_is_allocated_from_the_pool_of_the_node_its_pod_is_on(cluster, second_node):
    cluster.template("one-gpu", [cluster.gpus(1)])
    cluster.pod("there", {"gpus": "one-gpu"}, node=second_node.name)
    [claim] = cluster.wait_allocated("there")
    assert cluster.get_pod("there")["spec"]["nodeName"] == second_node.name
    [result] = _results(claim)
    assert result["pool"] == naming.pool_name(RESOURCE, second_node.name)
    [info] = cluster.prepare("there")  # by that node's kubelet, from that node's host
    [device] = info.devices[DRIVER]
    assert all(i in cluster.cdi_ids_on_disk(second_node.name) for i in device.cdi_device_ids)
    assert not set(device.cdi_device_ids) & set(cluster.cdi_ids_on_disk(NODE))


def test_a_container_with_two_claims_is_told_both_gpus_after_cdi_injection(cluster):
    """Two claims made from templates in one container: the host reads the pod (its claim
    statuses name the claims) and the other claim, so each claim's request entry lists both
    GPUs; after the runtime's injection every list variable the GPUs' own entries set names
    exactly the two GPUs."""
    from device_plugin_host_testing.cdi_runtime import CdiCache, container_cdi_ids

    cluster.template("one-gpu", [cluster.gpus(1)])
    cluster.pod("pair", {"first": "one-gpu", "second": "one-gpu"})
    claims = cluster.wait_allocated("pair")
    assert len({r["device"] for c in claims for r in _results(c)}) == 2
    infos = {info.name: info for info in cluster.prepare("pair")}
    pod = cluster.get_pod("pair")
    named = {s["name"]: s["resourceClaimName"] for s in pod["status"]["resourceClaimStatuses"]}
    pod_claims = [(c["name"], infos[named[c["name"]]]) for c in pod["spec"]["resourceClaims"]]
    ids = container_cdi_ids(pod_claims, [("first", ""), ("second", "")])
    cache = CdiCache(cluster.plane.nodes[NODE].cdi_dir)
    environ = cache.inject(ids).environ()
    own: Dict[str, List[str]] = {}
    for device in [d for info in infos.values() for d in info.devices[DRIVER]]:
        entry = cache.devices[device.cdi_device_ids[0]][1]
        for item in entry["containerEdits"].get("env") or ():
            key, value = item.split("=", 1)
            own.setdefault(key, []).append(value)
    lists = {k: v for k, v in own.items() if len(set(v)) == 2}
    assert lists, own  # the GPUs' own entries name each GPU (NVIDIA_VISIBLE_DEVICES, ...)
    for key, values in lists.items():
        assert sorted(environ[key].split(",")) == sorted(values), (key, environ[key])


SHARED_NODE = "dra-shared-1"
SHARING = REPO / "examples" / "dra-sharing"


@pytest.fixture(scope="module")
def shared_node(control_plane: ControlPlane) -> NodeHost:
    """A Node with examples/dra-sharing/config.toml: each GPU shared four ways, published
    once with allowMultipleAllocations and a ``shares`` capacity of 4."""
    shipped = (SHARING / "config.toml").read_text()
    return control_plane.add_node(
        SHARED_NODE, MACHINE, shipped[shipped.index("[[resource]]"):], [DRIVER],
        lambda server: len(server.devices(DRIVER, SHARED_NODE)) == GPUS)


def _example_template(name: str, pin_bus: str) -> Dict[str, Any]:
    """A ResourceClaimTemplate of examples/dra-sharing/claims.yaml, pinned to one GPU."""
    [template] = [d for d in yaml.safe_load_all((SHARING / "claims.yaml").read_text())
                  if d and d["kind"] == "ResourceClaimTemplate"
                  and d["metadata"]["name"] == name]
    [request] = template["spec"]["spec"]["devices"]["requests"]
    request["exactly"]["selectors"] = [{"cel": {"expression": (
        f'device.attributes["resource.kubernetes.io"].pciBusID == "{pin_bus}"')}}]
    return template  # type: ignore[no-any-return]


def test_claims_get_shares_of_one_gpu_until_its_capacity_is_spent(cluster, shared_node):
    """The real scheduler's consumable-capacity allocator with the example's config and
    claims: two claims of two shares each (``gpu-half``) get one GPU of four shares, each
    its own shareID; a one-share claim (``gpu-share``) then finds it spent. Our prepare
    returns each share's id, and each share has CDI entries of its own."""
    published = cluster.plane.server.devices(DRIVER, SHARED_NODE)
    target, entry = sorted(published.items())[0]
    assert entry["allowMultipleAllocations"] is True
    assert entry["capacity"]["shares"]["value"] == "4"
    bus = entry["attributes"]["resource.kubernetes.io/pciBusID"]["string"]
    for name in ("gpu-half", "gpu-share"):
        cluster.api.create(f"{cluster._rs}/resourceclaimtemplates",
                           _example_template(name, bus))
    infos, shares = [], set()
    for name in ("a", "b"):
        cluster.pod(name, {"gpu": "gpu-half"}, node=SHARED_NODE)
        [claim] = cluster.wait_allocated(name)
        [result] = _results(claim)
        assert result["device"] == target and result["shareID"]
        assert result["consumedCapacity"] == {"shares": "2"}
        shares.add(result["shareID"])
        [info] = cluster.prepare(name)
        [device] = info.devices[DRIVER]
        assert device.share_id == result["shareID"] and device.device_name == target
        infos.append(info)
    assert len(shares) == 2
    ids = [set(info.cdi_devices()) for info in infos]
    assert not ids[0] & ids[1]
    on_disk = cluster.cdi_ids_on_disk(SHARED_NODE)
    assert all(i in on_disk for i in ids[0] | ids[1])
    cluster.pod("c", {"gpu": "gpu-share"}, node=SHARED_NODE)
    cluster.wait_unschedulable("c", "cannot allocate all claims")
