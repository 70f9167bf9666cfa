"""Upgrades: how long a node cannot admit device-plugin pods or prepare claims while the host
is replaced, with kubelet Allocate calls and DRA prepares running throughout.

Two real ``device-plugin-host run`` processes (the old and the new version, each with its own
instance id) serve a fake node: two AMD GPUs through the device plugin API (``amd.com/gpu``)
and three NVIDIA GPUs through DRA (``nvidia.com/gpu``), against the device-plugin kubelet
stand-in, the DRA kubelet stand-in and the API server stand-in in this process.

* ``handover``: the new host starts while the old one runs (a DaemonSet with ``maxSurge: 1``,
  or the package's upgrade); it serves and registers beside the old one, which drains and
  exits (host/cli/lock.py).
* ``restart`` (the floor of today's upgrades): the old host stops, then the new one starts.

Keys: ``upgrade_gap_ms_device_plugin`` (time the kubelet's allocatable for the resource was
0) and ``upgrade_gap_ms_dra`` (time no registered, connected DRA endpoint could take a
prepare, plus prepares that failed), each with the same run's stop→start gap as its floor.
The device-plugin figure is for a 1.36 kubelet (which closes the new host's stream when the
old host's ends, so the new one registers once more); the note gives 1.37's.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from benchmarks.core import Context, Figure

REPO = Path(__file__).resolve().parents[1]
NODE = "node-1"
DP_RESOURCE = "amd.com/gpu"
DRA_RESOURCE = "nvidia.com/gpu"
NVIDIA = ("0000:18:00.0", "0000:3b:00.0", "0000:86:00.0")  # the last held across
AMD = ("0000:c1:00.0", "0000:83:00.0")
KEYS = ("upgrade_gap_ms_device_plugin", "upgrade_gap_ms_dra")
SAMPLE_S = 0.001


@dataclass
class Outcome:
    dp_gap_s: float = 0.0
    dra_gap_s: float = 0.0
    allocations: int = 0
    allocate_failures: List[str] = field(default_factory=list)
    prepares: int = 0
    prepare_failures: List[str] = field(default_factory=list)
    old_exit: Optional[int] = None
    held_claim_unprepared: bool = False
    old_waited: bool = False


def make_node(root: str, short: str, kubeconfig: str) -> str:
    """The fake machine and the config file both hosts run with; returns the config path."""
    from host.sim import fake_gpu
    from host.sim.tree import FakeTree

    tree = FakeTree(os.path.join(root, "host"))
    tree.numa_nodes(1)
    fake_gpu.add_nvidia_control_nodes(tree)
    for minor, address in enumerate(NVIDIA):
        fake_gpu.add_nvidia_gpu(tree, address, minor=minor, numa_node=0)
    for card, address in enumerate(AMD):
        fake_gpu.add_amd_gpu(tree, address, card=card + 1, render=128 + card, numa_node=0)
    for directory in ("dp", "reg", "plugins"):
        os.makedirs(os.path.join(short, directory), exist_ok=True)
    os.makedirs(os.path.join(root, "state"), mode=0o700, exist_ok=True)
    config = os.path.join(root, "config.toml")
    with open(config, "w", encoding="utf-8") as handle:
        handle.write(
            f'[host]\nplugin_dir = "{short}/dp"\nmetrics_address = ""\n'
            f'drain_file = "{root}/state/drained"\nnode_name = "{NODE}"\n'
            f'kubeconfig = "{kubeconfig}"\nplugins_registry_dir = "{short}/reg"\n'
            f'dra_plugins_dir = "{short}/plugins"\ndra_state_dir = "{root}/state/dra"\n'
            f'cdi_dir = "{root}/cdi"\nnfd_features_file = ""\n'
            f'[[resource]]\nname = "{DP_RESOURCE}"\ndriver = "gpu"\n'
            '[resource.selectors]\nvendor = "0x1002"\n'
            f'[[resource]]\nname = "{DRA_RESOURCE}"\ndriver = "gpu"\napi = "dra"\n'
            '[resource.selectors]\nvendor = "0x10de"\n')
    return config


async def start_host(config: str, root: str, instance: str,
                     pod: bool = False) -> asyncio.subprocess.Process:
    """``pod``: as in a DaemonSet (POD_UID names the instance)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("INVOCATION_ID", "POD_UID", "KUBERNETES_SERVICE_HOST", "NODE_NAME")}
    env.update(PYTHONPATH=str(REPO))
    if pod:
        env.update(POD_UID=instance, KUBERNETES_SERVICE_HOST="10.96.0.1",
                   POD_NAME=f"device-plugin-host-{instance}", POD_NAMESPACE="device-plugin-host")
    else:
        env.update(INVOCATION_ID=instance)
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "host", "run", "--config", config, "--host-root",
        os.path.join(root, "host"), env=env, cwd=str(REPO),
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)


async def scenario(root: str, short: str, api: Any, *, mode: str,
                   kubelet_version: Tuple[int, int] = (1, 36), pods: bool = False) -> Outcome:
    """One upgrade (``mode`` "handover" or "restart") under load; see the module text.
    ``pods``: the hosts run as DaemonSet pods: the old one, handed over, waits for its
    SIGTERM (the rollout deleting it) instead of exiting; ``old_exit`` is then its status
    after that SIGTERM, and ``old_waited`` whether it was still there."""
    from host.cli.lock import running_host
    from host.dra import claim_cdi, naming
    from host.dra.kube import KubeClient
    from host.sim.kubelet import KubeletSimulator
    from host.sim.kubelet_dra import DraKubeletSimulator

    api.add_node(NODE)
    config = make_config_once(root, short, api)
    driver = naming.driver_name(DRA_RESOURCE, None, "gpu")
    pool = naming.pool_name(DRA_RESOURCE, NODE)
    outcome = Outcome()
    dp = KubeletSimulator(os.path.join(short, "dp"), kubelet_version=kubelet_version)
    await dp.start()
    client = KubeClient.from_settings(api.kubeconfig_path)
    dra = DraKubeletSimulator(os.path.join(short, "reg"), get_claim=client.get_resource_claim,
                              node_name=NODE)
    await dra.start()
    claims = []
    for index, address in enumerate(NVIDIA[:2]):
        pod = str(uuid.uuid4())
        api.put_resource_claim({
            "metadata": {"name": f"c{index}", "namespace": "default"},
            "spec": {"devices": {"requests": [
                {"name": "gpu", "exactly": {"deviceClassName": "gpu"}}]}},
            "status": {"allocation": {"devices": {"results": [
                {"request": "gpu", "driver": driver, "pool": pool,
                 "device": naming.dra_device_name(address)}]}},
                "reservedFor": [{"resource": "pods", "name": f"p{index}", "uid": pod}]}})
        claims.append((pod, f"c{index}"))
    hosts: List[asyncio.subprocess.Process] = []
    stop = asyncio.Event()

    def allocatable() -> int:
        state = dp.resources.get(DP_RESOURCE)
        return 0 if state is None else state.allocatable

    def usable() -> bool:
        plugin = dra.plugin(driver)
        return plugin is not None and dra._connected(plugin)

    async def ready(instance: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            plugin = dra.plugin(driver)
            if (allocatable() == len(AMD) and plugin is not None and instance in plugin.endpoint
                    and usable() and len(api.devices(driver, NODE)) == len(NVIDIA)):
                return
            await asyncio.sleep(0.01)
        errors = b"".join([await h.stderr.read(4000) for h in hosts if h.returncode is not None
                           and h.stderr is not None])
        raise TimeoutError(f"host {instance} not ready: {dp.describe()}; {errors[-2000:]!r}")

    async def monitor() -> None:
        last = time.monotonic()
        while not stop.is_set():
            await asyncio.sleep(SAMPLE_S)
            now = time.monotonic()
            if allocatable() == 0:
                outcome.dp_gap_s += now - last
            if not usable():
                outcome.dra_gap_s += now - last
            last = now

    async def allocate_loop() -> None:
        index = 0
        while not stop.is_set():
            index += 1
            try:
                await dp.allocate(DP_RESOURCE, 1, pod=f"dp{index}")
                outcome.allocations += 1
            except (Exception, asyncio.CancelledError) as error:
                # Every failure is what a pod would see; a call in flight on a connection
                # the kubelet closes fails ("the client connection is closing"), which
                # grpc.aio reports as a cancellation (this task is never cancelled).
                outcome.allocate_failures.append(f"{type(error).__name__}: {error}")
            dp.release(f"dp{index}")
            await asyncio.sleep(0.002)

    async def prepare_loop() -> None:
        index = 0
        while not stop.is_set():
            pod, name = claims[index % len(claims)]
            index += 1
            try:
                await dra.prepare(pod, [("default", name)])
                await dra.unprepare(pod)
                outcome.prepares += 1
            except (Exception, asyncio.CancelledError) as error:  # as for Allocate
                outcome.prepare_failures.append(f"{type(error).__name__}: {error}")
                dra.claims.clear()  # the kubelet retries the pod from scratch
            await asyncio.sleep(0.002)

    try:
        old = await start_host(config, root, "old1", pods)
        hosts.append(old)
        await ready("old1")
        # A claim prepared by the old host and held across the upgrade: the new host must
        # unprepare it (the shared checkpoint), and keep its CDI spec meanwhile.
        held_pod, held_name = str(uuid.uuid4()), "held"
        held_claim = api.put_resource_claim({
            "metadata": {"name": held_name, "namespace": "default"},
            "spec": {"devices": {"requests": [
                {"name": "gpu", "exactly": {"deviceClassName": "gpu"}}]}},
            "status": {"allocation": {"devices": {"results": [
                {"request": "gpu", "driver": driver, "pool": pool,
                 "device": naming.dra_device_name(NVIDIA[2])}]}},
                "reservedFor": [{"resource": "pods", "name": "h", "uid": held_pod}]}})
        [held] = await dra.prepare(held_pod, [("default", held_name)])
        assert held.devices[driver], "the held claim got no device"
        tasks = [asyncio.ensure_future(f()) for f in (monitor, allocate_loop, prepare_loop)]
        await asyncio.sleep(0.3)
        if mode == "restart":
            old.terminate()
            outcome.old_exit = await asyncio.wait_for(old.wait(), 30)
        new = await start_host(config, root, "new2", pods)
        hosts.append(new)
        if mode == "handover" and not pods:
            outcome.old_exit = await asyncio.wait_for(old.wait(), 60)
        await ready("new2")
        state = os.path.join(root, "state")
        plugin_dir = os.path.join(short, "dp")
        for _ in range(400):
            holder = running_host(plugin_dir, state)
            if holder is not None and holder.pid == new.pid:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.5)  # the load runs on against the new host alone
        if pods and mode == "handover":
            outcome.old_waited = old.returncode is None
            old.terminate()  # the rollout deletes the old pod
            outcome.old_exit = await asyncio.wait_for(old.wait(), 20)
        stop.set()
        await asyncio.gather(*tasks)
        # The old host's CDI spec of the held claim stayed through the hand-over, and the
        # new host (which never prepared it) removes it at unprepare.
        spec = claim_cdi.spec_path(os.path.join(root, "cdi"), held_claim["metadata"]["uid"],
                                   DRA_RESOURCE)
        kept = os.path.exists(spec)
        await dra.unprepare(held_pod)
        outcome.held_claim_unprepared = kept and not os.path.exists(spec)
    finally:
        stop.set()
        for host in hosts:
            if host.returncode is None:
                host.terminate()
                try:
                    await asyncio.wait_for(host.wait(), 20)
                except asyncio.TimeoutError:
                    host.kill()
                    await host.wait()
        await dra.stop()
        await dp.stop()
        await client.close()
    return outcome


def make_config_once(root: str, short: str, api: Any) -> str:
    path = os.path.join(root, "config.toml")
    return path if os.path.exists(path) else make_node(root, short, api.kubeconfig_path)


async def _one(mode: str, version: Tuple[int, int]) -> Outcome:
    from host.sim.apiserver import ApiServerStandIn

    root = tempfile.mkdtemp(prefix="dph-upgrade-")
    short = tempfile.mkdtemp(prefix="dpu", dir="/tmp")
    api = ApiServerStandIn()
    api.start()
    try:
        return await scenario(root, short, api, mode=mode, kubelet_version=version)
    finally:
        api.close()
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(short, ignore_errors=True)


async def _measure(ctx: Context) -> List[Figure]:
    runs = ctx.pick(3, 1, 1)
    results: Dict[str, List[Outcome]] = {"handover": [], "restart": [], "handover137": []}
    for _ in range(runs):
        results["restart"].append(await _one("restart", (1, 36)))
        results["handover"].append(await _one("handover", (1, 36)))
        results["handover137"].append(await _one("handover", (1, 37)))

    def worst(mode: str, attr: str) -> float:
        return max(getattr(o, attr) for o in results[mode]) * 1000

    def failures(mode: str) -> str:
        return (f"{sum(len(o.allocate_failures) for o in results[mode])} of "
                f"{sum(o.allocations + len(o.allocate_failures) for o in results[mode])} "
                f"Allocate and {sum(len(o.prepare_failures) for o in results[mode])} of "
                f"{sum(o.prepares + len(o.prepare_failures) for o in results[mode])} prepares "
                "failed")
    return [
        Figure("upgrade_gap_ms_device_plugin", worst("handover", "dp_gap_s"), "ms",
               floor=worst("restart", "dp_gap_s"),
               notes=[f"worst of {runs}; kubelet 1.36 stand-in; floor: stop then start",
                      f"kubelet 1.37 (clients by name and path): "
                      f"{worst('handover137', 'dp_gap_s'):.1f} ms",
                      f"hand-over: {failures('handover')}; stop→start: {failures('restart')}"]),
        Figure("upgrade_gap_ms_dra", worst("handover", "dra_gap_s"), "ms",
               floor=worst("restart", "dra_gap_s"),
               notes=[f"worst of {runs}; no connected DRA endpoint; floor: stop then start"]),
    ]


def run(ctx: Context) -> List[Figure]:
    return asyncio.run(_measure(ctx))
