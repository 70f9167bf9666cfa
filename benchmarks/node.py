"""On a whole real node (tests/node/nodelib.py: the real kubelet v1.36.2, containerd 1.7 with
CDI, the real control plane, as root): how long a pod takes from creation to every container
running with its GPU, through the device plugin and through DRA, against a pod without devices
created the same way in the same run (the floor: the kubelet, the runtime and the busybox
container themselves); and how long a container killed right after a host restart (SIGTERM,
a new host started) takes to run again with its GPU, against the same kill with the host left
running. Skipped, with the reason, where the node cannot run (not root, no
``../shared/k8s/kubelet.xz``, no container runtime) and in the test suite's tiny runs.
"""

from __future__ import annotations

import importlib.util
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, List

from benchmarks.core import Context, Figure, Skipped, median, summary

KEYS = ("node_dp_pod_running_ms", "node_dra_pod_running_ms", "node_host_restart_device_ms")
GPU = "nvidia.com/gpu"
DRA_CLASS = "gpu.nvidia.com.device-plugin-host.io"


def _nodelib() -> Any:
    path = Path(__file__).resolve().parents[1] / "tests" / "node" / "nodelib.py"
    if not path.is_file():
        raise Skipped(f"no {path} (the whole-node kit lives in the source tree)")
    spec = importlib.util.spec_from_file_location("nodelib", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["nodelib"] = module
    spec.loader.exec_module(module)
    return module


def run(ctx: Context) -> List[Figure]:
    if ctx.tiny:
        raise Skipped("the whole node is measured only in a real run")
    lib = _nodelib()
    reason = lib.skip_reason()
    if reason:
        raise Skipped(reason)
    rounds = ctx.pick(4, 2, 1)  # 2 pods of 1 GPU a round: 8 GPUs
    node = lib.Node(lib.unpack_assets())
    try:
        node.start()
        with tempfile.TemporaryDirectory(prefix="dphb-node-") as work:
            return _measure(lib, node, Path(work), rounds)
    finally:
        node.close()


def _pod_ms(lib: Any, pods: Any, name: str, containers: List[Any], **kwargs: Any) -> float:
    start = time.monotonic()
    pods.create(name, containers, **kwargs)
    pods.running(name, timeout=90)
    elapsed = (time.monotonic() - start) * 1000
    return elapsed


def _measure(lib: Any, node: Any, work: Path, rounds: int) -> List[Figure]:
    floor: List[float] = []
    dra: List[float] = []
    dp: List[float] = []
    # DRA first: a name the kubelet has seen from a device plugin stays on the Node a while.
    host = lib.Host(node, work / "dra", lib.gpu_resources(api="dra")).start()
    pods = lib.Pods(node)
    try:
        lib.until("DRA driver registered", lambda: host.alive() and host.dra_registered(),
                  timeout=60)
        for i in range(rounds):
            floor.append(_pod_ms(lib, pods, f"floor-{i}", [lib.container("a")]))
            pods.api.create(f"{pods.rs}/resourceclaimtemplates", {
                "metadata": {"name": f"t{i}"}, "spec": {"spec": {"devices": {"requests": [{
                    "name": "gpu", "exactly": {"deviceClassName": DRA_CLASS, "count": 1}}]}}}})
            dra.append(_pod_ms(lib, pods, f"dra-{i}", [lib.container("a", claims=[{
                "name": "g"}])], claims=[{"name": "g", "resourceClaimTemplateName": f"t{i}"}],
                bind=False))
            assert len(pods.seen(f"dra-{i}", "a").gpus) == 1
            pods.delete_all()
            pods = lib.Pods(node)
    finally:
        pods.delete_all()
        host.stop()
    host = lib.Host(node, work / "dp", lib.gpu_resources(extra="cdi = true\n")).start()
    pods = lib.Pods(node)
    restart: List[float] = []
    restart_floor: List[float] = []
    floor_dp: List[float] = []  # the floor again beside the device plugin's pods
    try:
        lib.wait_allocatable(GPU, lib.GPU_ADDRESSES, host)
        for i in range(rounds):
            floor_dp.append(_pod_ms(lib, pods, f"floor-{i}", [lib.container("a")]))
            for name in (f"dp-{i}", f"dq-{i}"):
                dp.append(_pod_ms(lib, pods, name, [lib.container("a", {GPU: 1})]))
                assert len(pods.seen(name, "a").gpus) == 1
        # Each container is killed once (its first restart: the kubelet's crash-loop backoff
        # starts only at the second), dp-i with the host running, dq-i after a host restart.
        for i in range(rounds):
            restart_floor.append(_restart_ms(lib, node, pods, f"dp-{i}", 1))
        for i in range(rounds):
            host.stop()
            host = lib.Host(node, work / f"dp-again-{i}",
                            lib.gpu_resources(extra="cdi = true\n")).start()
            lib.wait_allocatable(GPU, lib.GPU_ADDRESSES, host)
            restart.append(_restart_ms(lib, node, pods, f"dq-{i}", 1))
    finally:
        pods.delete_all()
        host.stop()
    return [
        Figure("node_dp_pod_running_ms", median(dp), "ms", median(floor_dp), notes=[
            f"pod with 1 GPU (device plugin, CDI) created -> running; {summary(dp, 'ms')}; "
            f"floor: the same pod without devices, {summary(floor_dp, 'ms')}"]),
        Figure("node_dra_pod_running_ms", median(dra), "ms", median(floor), notes=[
            "pod with a ResourceClaimTemplate for 1 GPU created -> running (scheduler, "
            f"prepare, CDI); {summary(dra, 'ms')}; floor: a pod without devices created "
            f"between them, {summary(floor, 'ms')}"]),
        Figure("node_host_restart_device_ms", median(restart), "ms", median(restart_floor),
               notes=["container killed right after the host restarted and registered -> "
                      f"running again with its GPU; {summary(restart, 'ms')}; floor: the same "
                      f"kill with the host running, {summary(restart_floor, 'ms')}"]),
    ]


def _restart_ms(lib: Any, node: Any, pods: Any, name: str, count: int) -> float:
    """Kill the pod's container; the time until it runs again (restart ``count``) having
    printed its GPU."""
    pod = pods.get(name)
    start = time.monotonic()
    node.kill_container(pod, "a")

    def back() -> bool:
        status = pods.get(name)["status"]["containerStatuses"][0]
        return status["restartCount"] >= count and "running" in status["state"]
    lib.until(f"{name} running again", back, timeout=90, every=0.05)
    elapsed = (time.monotonic() - start) * 1000
    assert len(pods.seen(name, "a").gpus) == 1
    return elapsed
