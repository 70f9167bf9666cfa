"""Scenarios on the whole node (nodelib.Node): every container checked from inside (its
``/dev``, its environment, its mounts), through pods the real kubelet runs on containerd with
CDI. The host serves the GPU machine's tree (8 H100s, 0-3 on NUMA node 0, 4-7 on node 1); each
test starts its own host and waits on the kubelet's fresh registration (PodResources
GetAllocatableResources), never on the Node's lagging ``allocatable``."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import sys
import urllib.request
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence

import nodelib
import pytest
from nodelib import GPU_ADDRESSES, HOSTNAME, Host, Pods, container, gpu_resources, until

GPU = "nvidia.com/gpu"
NUMA0, NUMA1 = GPU_ADDRESSES[:4], GPU_ADDRESSES[4:]
CONTROL = {"nvidiactl", "nvidia-uvm"}
DRA_DRIVER = "gpu.nvidia.com.device-plugin-host.io"


class Hosts:
    """The test's hosts; stopped after its pods are gone (DRA unprepares through them)."""

    def __init__(self, node: nodelib.Node, root: Path) -> None:
        self.node, self.root, self.made = node, root, []  # type: ignore[var-annotated]

    def start(self, resources: str, name: str = "host", **kwargs: Any) -> Host:
        host = Host(self.node, self.root / name, resources, **kwargs).start()
        self.made.append(host)
        return host

    def dp(self, extra: str = "", ids: List[str] = GPU_ADDRESSES, **kwargs: Any) -> Host:
        host = self.start(gpu_resources(extra=extra), **kwargs)
        nodelib.wait_allocatable(GPU, ids, host)
        return host

    def dra(self, extra: str = "", ids: Sequence[str] = GPU_ADDRESSES, **kwargs: Any) -> Host:
        host = self.start(gpu_resources(api="dra", extra=extra, addresses=ids), **kwargs)
        until("our DRA driver registered with the kubelet and its slice published",
              lambda: host.alive() and host.dra_registered() and len(_slice_devices(
                  self.node)) == len(ids), timeout=60)
        return host


@pytest.fixture()
def hosts(node: nodelib.Node, tmp_path: Path) -> Iterator[Hosts]:
    made = Hosts(node, tmp_path)
    try:
        yield made
    finally:
        for host in reversed(made.made):
            host.stop()


@pytest.fixture()
def pods(node: nodelib.Node, hosts: Hosts) -> Iterator[Pods]:
    made = Pods(node)
    try:
        yield made
    finally:
        made.delete_all()


def _slice_devices(node: nodelib.Node) -> List[Dict[str, Any]]:
    slices = node.api.get("/apis/resource.k8s.io/v1/resourceslices")["items"]
    return [d for s in slices if s["spec"]["driver"] == DRA_DRIVER
            and s["spec"].get("nodeName") == HOSTNAME for d in s["spec"].get("devices") or ()]


def _uuid_of(address: str) -> str:
    for line in nodelib.machine_lines():
        if f"/proc/driver/nvidia/gpus/{address}/information" in line:
            return re.search(r"GPU UUID: \\t (GPU-[0-9a-f-]+)", line).group(1)  # type: ignore
    raise AssertionError(address)


def _minor(address: str) -> str:
    return f"nvidia{GPU_ADDRESSES.index(address)}"


def _check_gpus(seen: nodelib.Seen, count: int, fallback_mounts: bool = True) -> List[str]:
    """The container sees ``count`` GPUs, the control nodes, and is told exactly those."""
    assert len(seen.gpus) == count, seen.text
    assert seen.dev >= CONTROL, seen.text
    by_minor = {_minor(a): _uuid_of(a) for a in GPU_ADDRESSES}
    assert seen.visible == sorted(by_minor[g] for g in seen.gpus), seen.text
    return seen.gpus


def _dp_pod_check(pods: Pods) -> None:
    pods.create("p", [container("a", {GPU: 1}), container("b", {GPU: 2})])
    pods.running("p")
    a, b = _check_gpus(pods.seen("p", "a"), 1), _check_gpus(pods.seen("p", "b"), 2)
    assert not set(a) & set(b)


# ---------------------------------------------------------------- DRA
# First: once the kubelet has seen nvidia.com/gpu from a device plugin, the host refuses to
# serve the name through DRA on this node for as long as the kubelet keeps it.


def _claim_template(pods: Pods, name: str, requests: List[Dict[str, Any]],
                    constraints: Any = None, kind: str = "resourceclaimtemplates") -> None:
    devices: Dict[str, Any] = {"requests": requests}
    if constraints:
        devices["constraints"] = constraints
    spec = {"devices": devices}
    body = {"metadata": {"name": name},
            "spec": {"spec": spec} if kind == "resourceclaimtemplates" else spec}
    pods.api.create(f"{pods.rs}/{kind}", body)


def _gpus(name: str, count: int = 1) -> Dict[str, Any]:
    return {"name": name, "exactly": {"deviceClassName": DRA_DRIVER, "count": count}}


def test_dra_claim_requests_across_containers(hosts: Hosts, pods: Pods) -> None:
    hosts.dra()
    _claim_template(pods, "two", [_gpus("r0"), _gpus("r1")], kind="resourceclaims")
    pods.create("p", [container("a", claims=[{"name": "gpus", "request": "r0"}]),
                      container("b", claims=[{"name": "gpus", "request": "r1"}])],
                claims=[{"name": "gpus", "resourceClaimName": "two"}], bind=False)
    pods.running("p")
    a, b = pods.seen("p", "a"), pods.seen("p", "b")  # each sees and is told only its own
    assert len(a.gpus) == 1 and len(b.gpus) == 1 and a.gpus != b.gpus, (a.text, b.text)
    _check_gpus(a, 1)
    _check_gpus(b, 1)


def test_dra_two_claims_in_one_container(hosts: Hosts, pods: Pods) -> None:
    hosts.dra()
    for name in ("x", "y"):
        _claim_template(pods, name, [_gpus("gpu")])
    pods.create("p", [container("a", claims=[{"name": "x"}, {"name": "y"}])],
                claims=[{"name": n, "resourceClaimTemplateName": n} for n in ("x", "y")],
                bind=False)
    pods.running("p")
    _check_gpus(pods.seen("p", "a"), 2)


def test_dra_resource_claim_template(hosts: Hosts, pods: Pods) -> None:
    hosts.dra()
    _claim_template(pods, "two-gpus", [_gpus("gpus", 2)])
    pods.create("p", [container("a", claims=[{"name": "gpus"}])],
                claims=[{"name": "gpus", "resourceClaimTemplateName": "two-gpus"}], bind=False)
    pods.running("p")
    _check_gpus(pods.seen("p", "a"), 2)
    pods.delete_all()
    until("the claim's CDI spec removed", lambda: not [
        f for f in os.listdir(nodelib.CDI_DIR) if "claim" in f or DRA_DRIVER in f])


def test_dra_extended_resource_through_the_device_class(hosts: Hosts, pods: Pods) -> None:
    hosts.dra()
    pods.create("p", [container("a", {GPU: 1})], bind=False)
    pods.running("p", timeout=90)
    _check_gpus(pods.seen("p", "a"), 1)


def test_dra_numa_match_attribute(hosts: Hosts, pods: Pods) -> None:
    hosts.dra()
    _claim_template(pods, "numa", [_gpus("gpus", 3)], constraints=[{
        "requests": ["gpus"], "matchAttribute": "resource.kubernetes.io/numaNode"}])
    pods.create("p", [container("a", claims=[{"name": "gpus"}])],
                claims=[{"name": "gpus", "resourceClaimTemplateName": "numa"}], bind=False)
    pods.running("p")
    gpus = set(_check_gpus(pods.seen("p", "a"), 3))
    assert gpus <= {_minor(a) for a in NUMA0} or gpus <= {_minor(a) for a in NUMA1}, gpus


# ---------------------------------------------------------------- device plugin


def test_dra_sharing_through_consumable_capacity(hosts: Hosts, pods: Pods) -> None:
    """One GPU shared twice (replicas = 2): two pods, each with its own claim for one share,
    both run and both see that GPU; the allocator hands out no third share."""
    hosts.dra(extra="replicas = 2\n", ids=NUMA0[:1])
    devices = _slice_devices(hosts.node)
    assert [d.get("allowMultipleAllocations") for d in devices] == [True], devices
    assert devices[0]["capacity"]["shares"]["value"] == "2", devices
    for name in ("a", "b"):
        _claim_template(pods, name, [{"name": "gpu", "exactly": {
            "deviceClassName": DRA_DRIVER, "count": 1,
            "capacity": {"requests": {"shares": "1"}}}}])
        pods.create(name, [container("a", claims=[{"name": "g"}])],
                    claims=[{"name": "g", "resourceClaimTemplateName": name}], bind=False)
    seen = []
    for name in ("a", "b"):
        pods.running(name)
        seen.append(pods.seen(name, "a"))
        _check_gpus(seen[-1], 1)
    assert seen[0].gpus == seen[1].gpus, (seen[0].text, seen[1].text)


def test_dp_cdi_only(hosts: Hosts, pods: Pods) -> None:
    hosts.dp('cdi = true\ncdi_fallback = false\n')
    _dp_pod_check(pods)
    assert any(f.startswith("nvidia.com_gpu") or "nvidia" in f
               for f in os.listdir(nodelib.CDI_DIR))


def test_dp_cdi_with_fallback(hosts: Hosts, pods: Pods) -> None:
    hosts.dp('cdi = true\ncdi_fallback = true\n')
    _dp_pod_check(pods)


def test_dp_without_cdi(hosts: Hosts, pods: Pods) -> None:
    hosts.dp('cdi = false\n')
    _dp_pod_check(pods)


def test_dp_several_containers_and_resources(hosts: Hosts, pods: Pods) -> None:
    resources = "".join(gpu_resources(name, addresses=ids) for name, ids in (
        ("example.com/gpu-a", NUMA0), ("example.com/gpu-b", NUMA1)))
    host = hosts.start(resources)
    nodelib.wait_allocatable("example.com/gpu-a", NUMA0, host)
    nodelib.wait_allocatable("example.com/gpu-b", NUMA1, host)
    pods.create("p", [container("both", {"example.com/gpu-a": 2, "example.com/gpu-b": 1}),
                      container("b", {"example.com/gpu-b": 3}), container("none")])
    pods.running("p")
    both, b, none = (pods.seen("p", c) for c in ("both", "b", "none"))
    assert sorted(both.gpus) == sorted(both.gpus) and len(both.gpus) == 3, both.text
    assert len([g for g in both.gpus if g in {_minor(a) for a in NUMA0}]) == 2
    assert {_minor(a) for a in NUMA1} == set(b.gpus) | ({g for g in both.gpus
                                                         if g in {_minor(a) for a in NUMA1}})
    assert not none.gpus and not (CONTROL & none.dev), none.text
    assert "NVIDIA_VISIBLE_DEVICES" not in none.env


def test_dp_hot_plugged_device_reaches_allocatable_and_a_pod(node: nodelib.Node, hosts: Hosts,
                                                             pods: Pods) -> None:
    late = GPU_ADDRESSES[7]
    lines = [line for line in nodelib.machine_lines() if late in line or "/dev/nvidia7 " in line]
    from host.sim.tree import FakeTree

    tree = FakeTree(node.tree)
    for path in ("/dev/nvidia7", f"/sys/bus/pci/devices/{late}",
                 f"/proc/driver/nvidia/gpus/{late}"):
        tree.remove(path)
    for line in lines:  # the GPU's own sysfs directory
        if line.startswith("d /sys/devices/") and line.split()[1].endswith(late):
            shutil.rmtree(tree.real(line.split()[1]), ignore_errors=True)
    try:
        host = hosts.start(gpu_resources(extra="cdi = true\n"),
                           settings={"rescan_interval_s": 1})
        nodelib.wait_allocatable(GPU, GPU_ADDRESSES[:7], host)
        pods.create("seven", [container("a", {GPU: 7})])
        pods.running("seven")
        assert "nvidia7" not in pods.seen("seven", "a").gpus
        tree.load("\n".join(lines))  # plugged in
        nodelib.wait_allocatable(GPU, GPU_ADDRESSES, host, timeout=30)
        pods.create("eighth", [container("a", {GPU: 1})])
        pods.running("eighth")
        assert pods.seen("eighth", "a").gpus == ["nvidia7"]
    finally:
        tree.load("\n".join(lines))


def test_dp_unhealthy_device_not_handed_out(hosts: Hosts, pods: Pods) -> None:
    host = hosts.start(gpu_resources(extra="cdi = true\n"))
    nodelib.wait_allocatable(GPU, GPU_ADDRESSES, host)
    for address in GPU_ADDRESSES[1:]:
        drained = host.cli("drain", GPU, address, "--reason", "node test",
                           "--config", str(host.config))
        assert drained.returncode == 0, drained.stderr
    nodelib.wait_allocatable(GPU, GPU_ADDRESSES[:1], host)
    pods.create("one", [container("a", {GPU: 1})])
    pods.running("one")
    assert pods.seen("one", "a").gpus == ["nvidia0"]
    pods.create("two", [container("a", {GPU: 1})])
    until("second pod refused", lambda: pods.get("two")["status"].get("phase") == "Failed")
    assert "UnexpectedAdmissionError" in pods.get("two")["status"].get("reason", "")


def test_pods_command_reads_the_real_podresources_api(hosts: Hosts, pods: Pods) -> None:
    host = hosts.dp("cdi = true\n")
    pods.create("p", [container("a", {GPU: 1}), container("b", {GPU: 2})])
    pods.running("p")
    out = host.cli("pods", "--json")
    assert out.returncode == 0, out.stderr
    rows = [r for r in json.loads(out.stdout) if r.get("namespace") == pods.namespace]
    held = {r["container"]: sorted(r.get("devices") or r.get("device_ids") or [r.get("device")])
            for r in rows}
    for name in ("a", "b"):
        seen = pods.seen("p", name)
        assert held[name] == sorted(GPU_ADDRESSES[int(g[6:])] for g in seen.gpus), (rows, name)


# ---------------------------------------------------------------- operations


def test_kubelet_restart_with_pods_running(node: nodelib.Node, hosts: Hosts,
                                           pods: Pods) -> None:
    host = hosts.dp("cdi = true\n")
    pods.create("p", [container("a", {GPU: 2})])
    pods.running("p")
    before = pods.seen("p", "a").gpus
    node.stop_kubelet()
    node.start_kubelet()
    nodelib.wait_allocatable(GPU, GPU_ADDRESSES, host)
    pod = pods.running("p")
    assert pod["status"]["containerStatuses"][0]["restartCount"] == 0
    assert pods.seen("p", "a").gpus == before
    pods.create("q", [container("a", {GPU: 1})])
    pods.running("q")
    assert not set(pods.seen("q", "a").gpus) & set(before)


def test_host_restart_container_restart_gets_its_device(node: nodelib.Node, hosts: Hosts,
                                                        pods: Pods) -> None:
    """The host stopped (SIGTERM, as systemctl restart and a rollout do) and started again;
    a container that restarts meanwhile still gets its GPU."""
    host = hosts.dp("cdi = true\ncdi_fallback = false\n")
    pods.create("p", [container("a", {GPU: 1})])
    pod = pods.running("p")
    before = pods.seen("p", "a").gpus
    assert host.stop() == 0
    node.kill_container(pod, "a")
    hosts.dp("cdi = true\ncdi_fallback = false\n", name="again")

    def restarted() -> bool:
        status = pods.get("p")["status"]["containerStatuses"][0]
        return status["restartCount"] >= 1 and "running" in status["state"]
    until("container restarted with its GPU", restarted, timeout=60)
    assert pods.seen("p", "a").gpus == before


def test_simulated_reboot(node: nodelib.Node, hosts: Hosts, pods: Pods) -> None:
    """Every container gone, /var/run/cdi, the plugin directories and the host's /run state
    wiped, the kubelet and the host started again: the pod is admitted again with a GPU."""
    host = hosts.dp("cdi = true\ncdi_fallback = false\n")
    pods.create("p", [container("a", {GPU: 1})])
    pods.running("p")
    node.stop_kubelet()
    host.stop()
    node.kill_all_tasks()
    for directory in (nodelib.CDI_DIR, nodelib.PLUGIN_DIR, nodelib.KUBELET_ROOT / "plugins",
                      nodelib.KUBELET_ROOT / "plugins_registry", nodelib.RUN / "host-dra"):
        shutil.rmtree(directory, ignore_errors=True)
    node.start_kubelet()
    hosts.dp("cdi = true\ncdi_fallback = false\n", name="after")

    def again() -> bool:
        statuses = pods.get("p")["status"].get("containerStatuses") or []
        return bool(statuses) and "running" in statuses[0]["state"] and \
            statuses[0]["restartCount"] >= 1
    until("pod running again after the reboot", again, timeout=90)
    assert len(pods.seen("p", "a").gpus) == 1


def _unit_command() -> List[str]:
    unit = (nodelib.REPO / "deploy" / "systemd" / "device-plugin-host.service").read_text()
    line = next(ln for ln in unit.splitlines() if ln.startswith("ExecStart="))
    return shlex.split(line.split("=", 1)[1])


def test_host_as_the_systemd_unit_runs_it(hosts: Hosts, pods: Pods, tmp_path: Path) -> None:
    argv = _unit_command()
    assert os.path.basename(argv[0]) == "device-plugin-host"
    config = argv.index("--config") + 1
    host = hosts.start(gpu_resources(extra="cdi = true\n"), name="unit")
    argv[0:1] = [sys.executable, "-m", "host"]  # the installed entry point's module
    argv[config + 2] = str(host.config)
    host.stop()
    host.argv = [*argv, "--host-root", str(host.node.tree)]
    host.start()
    nodelib.wait_allocatable(GPU, GPU_ADDRESSES, host)
    pods.create("p", [container("a", {GPU: 1})])
    pods.running("p")
    _check_gpus(pods.seen("p", "a"), 1)
    assert host.stop() == 0


def test_upgrade_old_and_new_host_with_pods_running(node: nodelib.Node, hosts: Hosts,
                                                    pods: Pods, tmp_path: Path) -> None:
    """A new host started beside the running old one (the same config and state directory,
    as a package upgrade or a rollout has) takes over with no gap: a container restarting
    during the handover gets its GPU at once."""
    same = {"drain_file": str(tmp_path / "state" / "drained")}
    old = hosts.dp("cdi = true\ncdi_fallback = false\n", name="old", settings=same)
    pods.create("p", [container("a", {GPU: 1})])
    pod = pods.running("p")
    new = hosts.start(gpu_resources(extra="cdi = true\ncdi_fallback = false\n"), name="new",
                      settings=same)
    until("the new host registered beside the old one",
          lambda: new.alive() and new.logged("resources registered"), timeout=30)
    old.stop()
    node.kill_container(pod, "a")

    def restarted() -> bool:
        status = pods.get("p")["status"]["containerStatuses"][0]
        return status["restartCount"] >= 1 and "running" in status["state"]
    until("restarted at once", restarted, timeout=15)


def test_move_a_resource_between_the_apis(node: nodelib.Node, hosts: Hosts,
                                          pods: Pods) -> None:
    """nvidia.com/gpu served by the device plugin (the Node shows it), then moved to DRA by a
    live change of the config (docs/migration.md): the Node drops the device plugin's capacity
    at the kubelet's next status write, our slice is published after that, and a pod asking
    for nvidia.com/gpu: 1 gets a GPU through the DeviceClass within 30 s of the change."""
    def node_gpus() -> Optional[str]:
        status = node.api.get(f"/api/v1/nodes/{HOSTNAME}")["status"]
        return status["allocatable"].get(GPU)

    host = hosts.dp("cdi = true\n", name="move")
    until("the Node shows the device plugin's GPUs", lambda: node_gpus() == "8", timeout=30)
    moved = host.config.read_text().replace('driver = "gpu"\n', 'driver = "gpu"\napi = "dra"\n')
    staged = host.config.with_name("config.toml.new")
    staged.write_text(moved)
    os.replace(staged, host.config)  # as a ConfigMap update swaps it: the host reloads
    until("the move done", lambda: host.alive() and host.logged("now served through dra"),
          timeout=30)
    assert node_gpus() in (None, "0"), node_gpus()  # never offered through both
    until("the pool published once the kubelet registered the driver",
          lambda: len(_slice_devices(node)) == len(GPU_ADDRESSES), timeout=10)
    pods.create("p", [container("a", {GPU: 1})], bind=False)
    pods.running("p", timeout=30)
    _check_gpus(pods.seen("p", "a"), 1)
    status = pods.get("p")["status"]
    assert status.get("extendedResourceClaimStatus"), status  # served through DRA


IMAGE_LAYOUT = nodelib.REPO / "build" / "image" / "oci"


def test_daemonset_image_serves_the_pods(node: nodelib.Node, pods: Pods, tmp_path: Path) -> None:
    """The image deploy/container/build made, imported into containerd, run by the kubelet as
    the DaemonSet's own pod (its command, user, securityContext, probe and mounts, from
    deploy/kubernetes/base/daemonset.yaml; only the host paths a test must not touch are
    moved, /sys to the machine's tree): the kubelet registers its GPUs, its liveness probe
    passes, and a pod asking for a GPU gets one."""
    import yaml

    if not (IMAGE_LAYOUT / "index.json").is_file():
        pytest.skip(f"no image in {IMAGE_LAYOUT}: `deploy/container/build --arch amd64` "
                    "makes it (.ci/run does, where mmdebstrap can be installed)")
    tags = [(m.get("annotations") or {}).get("org.opencontainers.image.ref.name", "")
            for m in json.loads((IMAGE_LAYOUT / "index.json").read_text())["manifests"]]
    [tag] = [t for t in tags if t.endswith("-amd64")]
    ref = node.import_image(IMAGE_LAYOUT, tag, "localhost/device-plugin-host:node-test")
    manifest = nodelib.REPO / "deploy" / "kubernetes" / "base" / "daemonset.yaml"
    [daemonset] = [d for d in yaml.safe_load_all(manifest.read_text())
                   if d and d.get("kind") == "DaemonSet"]
    template = daemonset["spec"]["template"]
    spec = template["spec"]
    spec["nodeName"] = HOSTNAME  # what the DaemonSet controller's pod for this node names
    [main] = spec["containers"]
    main["image"], main["imagePullPolicy"] = ref, "Never"
    moved = {"sys": str(node.tree / "sys")}
    for volume in spec["volumes"]:
        path = (volume.get("hostPath") or {}).get("path", "")
        if volume["name"] in moved:
            volume["hostPath"]["path"] = moved[volume["name"]]
        elif path and not path.startswith(("/var/lib/kubelet", "/var/run/cdi", "/dev")):
            (tmp_path / volume["name"]).mkdir()
            volume["hostPath"]["path"] = str(tmp_path / volume["name"])  # state, NFD, ...
    base = (manifest.parent / "config.toml").read_text()
    config_map = next(v["configMap"]["name"] for v in spec["volumes"] if "configMap" in v)
    node.api.create(f"{pods.ns}/configmaps", {"metadata": {"name": config_map}, "data": {
        "config.toml": base + "\n" + gpu_resources(extra="cdi = true\n")}})
    pods.submit({"name": "host", **template["metadata"]}, spec)
    pods.running("host", timeout=60)
    nodelib.wait_allocatable(GPU, GPU_ADDRESSES, None)
    pods.create("p", [container("a", {GPU: 1})])
    pods.running("p")
    # The container's own procfs lacks the tree's /proc/driver/nvidia (a real node's kernel
    # shows it in every procfs; runc mounts nothing under /proc): the host numbers the minors
    # in PCI order and names the GPU by its PCI address, which NVIDIA's toolkit accepts.
    seen = pods.seen("p", "a")
    assert len(seen.gpus) == 1 and seen.dev >= CONTROL, seen.text
    assert seen.visible == [GPU_ADDRESSES[int(seen.gpus[0][len("nvidia"):])]], seen.text
    pod = pods.get("host")
    [status] = pod["status"]["containerStatuses"]
    assert status["restartCount"] == 0 and status["ready"], status
    probe = main["livenessProbe"]["httpGet"]
    port = next(p["containerPort"] for p in main["ports"] if p["name"] == probe["port"])
    url = f"http://{pod['status']['podIP']}:{port}{probe['path']}"
    with urllib.request.urlopen(url, timeout=5) as answer:  # what the kubelet's probe gets
        assert answer.status == 200, url

