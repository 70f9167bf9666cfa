"""NodePrepareResources / NodeUnprepareResources round trips, kubelet to host, against a bare
grpc.aio unary call.

Setup: the host runs in its own process (``benchmarks.draproc``: the real HostApp with one DRA
resource of 8 MemoryDriver devices), the API-server stand-in (real HTTP) and the DRA kubelet
simulator in this one. Each cycle seeds a fresh ResourceClaim allocated to one device, then
times, through the simulator's bare RPC client (``node_prepare``/``node_unprepare``):

* a first prepare: the claim GET from the API server, the GET of the pod it is reserved for
  (its containers' claim references), the driver hook, a fsynced CDI spec and
  a fsynced checkpoint write, the answer (what the kubelet waits for before the sandbox);
* the same prepare again: the kubelet's retry / restart path, answered from the checkpoint;
* the unprepare: the spec removed, the checkpoint written again;
* a first prepare of a share of a device several claims use (``dra_prepare_shared_*``: a
  claim allocated with a ``shareID`` and ``consumedCapacity`` on a ``replicas`` resource, whose
  shares are counted and get CDI entries of their own), then its unprepare.

Floor: a grpc.aio echo server in its own process, called from here on a channel with the
simulator's options, with the same NodePrepareResourcesRequest built and parsed the same way.
Host and floor calls alternate cycle by cycle so that drift hits both equally.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from typing import Any, Dict, List, Tuple

import grpc

from benchmarks import draproc
from benchmarks.core import Context, Figure, child_process, median, now, percentile, short_dir
from benchmarks.floors import CLIENT_OPTIONS, ECHO_METHOD
from host.core.fileio import write_atomic
from host.dra import naming
from host.dra.kube import KubeClient
from host.dra.protocol import dra_v1
from host.sim.apiserver import ApiServerStandIn
from host.sim.kubelet_dra import DraKubeletSimulator

KEYS = ("dra_prepare_median_ms", "dra_prepare_p99_ms", "dra_prepare_again_median_us",
        "dra_unprepare_median_ms", "dra_prepare_shared_median_ms")
NODE = "bench-node"
DEVICES = 8


async def _measure(ctx: Context) -> List[Figure]:
    cycles = ctx.pick(400, 100, 5)
    warmup = ctx.pick(30, 10, 1)
    driver = naming.driver_name(draproc.RESOURCE, None)
    pool = naming.pool_name(draproc.RESOURCE, NODE)
    shared_driver = naming.driver_name(draproc.SHARED, None)
    shared_pool = naming.pool_name(draproc.SHARED, NODE)
    samples: dict = {"prepare": [], "again": [], "unprepare": [], "floor": [], "get": [],
                     "writes": [], "shared": []}
    with ApiServerStandIn() as api, short_dir() as root:
        api.add_node(NODE)
        client = KubeClient.from_settings(api.kubeconfig_path)
        dirs = draproc.dirs(root)
        sim = DraKubeletSimulator(dirs["plugins_registry_dir"],
                                  get_claim=client.get_resource_claim, node_name=NODE)
        await sim.start()
        echo_path = os.path.join(root, "echo.sock")
        try:
            async with child_process(["-m", "benchmarks.draproc", "--kubeconfig",
                                      api.kubeconfig_path, "--root", root, "--node", NODE,
                                      "--devices", str(DEVICES)]), child_process(
                    ["-m", "benchmarks.floors", "echo", "--socket", echo_path]):
                await sim.wait_registered(driver, shared_driver, timeout=30)
                channel = grpc.aio.insecure_channel(f"unix:{echo_path}", options=CLIENT_OPTIONS)
                try:
                    await asyncio.wait_for(channel.channel_ready(), 10)
                    echo = channel.unary_unary(
                        ECHO_METHOD,
                        request_serializer=dra_v1.NodePrepareResourcesRequest.SerializeToString,
                        response_deserializer=dra_v1.NodePrepareResourcesRequest.FromString)
                    for index in range(warmup + cycles):
                        name = f"claim-{index}"
                        # The pod the claim is reserved for: its one container uses it.
                        pod = api.put_pod({
                            "metadata": {"name": "p", "namespace": "bench"},
                            "spec": {"resourceClaims": [{"name": "c",
                                                         "resourceClaimName": name}],
                                     "containers": [{"name": "main", "image": "pause",
                                                     "resources": {"claims": [
                                                         {"name": "c"}]}}]}})
                        claim = api.put_resource_claim({
                            "metadata": {"name": name, "namespace": "bench"},
                            "spec": {"devices": {"requests": [
                                {"name": "dev", "exactly": {"deviceClassName": "bench"}}]}},
                            "status": {"allocation": {"devices": {"results": [
                                {"request": "dev", "driver": driver, "pool": pool,
                                 "device": f"dev{index % DEVICES}"}]}},
                                "reservedFor": [{"resource": "pods", "name": "p",
                                                 "uid": pod["metadata"]["uid"]}]}})
                        ref = [("bench", name, claim["metadata"]["uid"])]
                        timings = await _cycle(sim, driver, echo, ref)
                        timings.update(await _parts(client, name, root))
                        shared_pod = api.put_pod({
                            "metadata": {"name": "ps", "namespace": "bench"},
                            "spec": {"resourceClaims": [{"name": "c",
                                                         "resourceClaimName": f"shared-{index}"}],
                                     "containers": [{"name": "main", "image": "pause",
                                                     "resources": {"claims": [
                                                         {"name": "c"}]}}]}})
                        shared = api.put_resource_claim({
                            "metadata": {"name": f"shared-{index}", "namespace": "bench"},
                            "spec": {"devices": {"requests": [
                                {"name": "dev", "exactly": {"deviceClassName": "bench"}}]}},
                            "status": {"allocation": {"devices": {"results": [
                                {"request": "dev", "driver": shared_driver,
                                 "pool": shared_pool,
                                 "device": f"shared{index % DEVICES}",
                                 "shareID": str(uuid.uuid4()),
                                 "consumedCapacity": {"shares": "1"}}]}},
                                "reservedFor": [{"resource": "pods", "name": "ps",
                                                 "uid": shared_pod["metadata"]["uid"]}]}})
                        timings["shared"] = await _shared_cycle(
                            sim, shared_driver, [("bench", f"shared-{index}",
                                                  shared["metadata"]["uid"])])
                        if index >= warmup:
                            for kind, elapsed in timings.items():
                                samples[kind].append(elapsed)
                finally:
                    await channel.close()
        finally:
            await sim.stop()
            await client.close()
    ms = [x * 1000 for x in samples["prepare"]]
    floor_ms = [x * 1000 for x in samples["floor"]]
    again_us = [x * 1e6 for x in samples["again"]]
    unprepare_ms = [x * 1000 for x in samples["unprepare"]]
    note = (f"host in its own process; API-server stand-in; {cycles} cycles; claim and pod GETs, "
            f"hook, fsynced CDI spec and checkpoint included; the unavoidable parts alone: "
            f"claim and pod GETs median {median(samples['get']) * 1000:.2f} ms, two fsynced file "
            f"replacements median {median(samples['writes']) * 1000:.2f} ms")
    return [
        Figure("dra_prepare_median_ms", median(ms), "ms", median(floor_ms), [note]),
        Figure("dra_prepare_p99_ms", percentile(ms, 99), "ms", percentile(floor_ms, 99),
               [f"n={cycles}"]),
        Figure("dra_prepare_again_median_us", median(again_us), "us",
               median(floor_ms) * 1000, ["a prepared claim again (kubelet retry/restart)"]),
        Figure("dra_unprepare_median_ms", median(unprepare_ms), "ms", median(floor_ms),
               ["spec removed, checkpoint rewritten"]),
        Figure("dra_prepare_shared_median_ms",
               median([x * 1000 for x in samples["shared"]]), "ms", median(floor_ms),
               [f"a share (shareID, consumedCapacity) of a device shared {draproc.SHARES} "
                f"ways; same floor and cycles as dra_prepare_median_ms"]),
    ]


async def _shared_cycle(sim: DraKubeletSimulator, driver: str,
                        ref: List[Tuple[str, str, str]]) -> float:
    """Seconds for the first prepare of a share; it is unprepared again afterwards."""
    started = now()
    response = await sim.node_prepare(driver, ref)
    elapsed = now() - started
    claim = response.claims[ref[0][2]]
    if claim.error or not claim.devices[0].share_id:
        raise RuntimeError(f"shared prepare failed: {claim.error or 'no share_id'}")
    await sim.node_unprepare(driver, ref)
    return elapsed


async def _cycle(sim: DraKubeletSimulator, driver: str, echo: Any,
                 ref: List[Tuple[str, str, str]]) -> Dict[str, float]:
    """Seconds for prepare, prepare again, unprepare and the floor's echo of one claim."""
    request = dra_v1.NodePrepareResourcesRequest(
        claims=[dra_v1.Claim(namespace=n, name=c, uid=u) for n, c, u in ref])
    out: Dict[str, float] = {}
    for kind in ("prepare", "again", "unprepare", "floor"):
        started = now()
        if kind == "floor":
            await echo(request)
        elif kind == "unprepare":
            await sim.node_unprepare(driver, ref)
        else:
            response = await sim.node_prepare(driver, ref)
            error = response.claims[ref[0][2]].error
            if error:
                raise RuntimeError(f"prepare failed: {error}")
        out[kind] = now() - started
    return out


async def _parts(client: KubeClient, name: str, root: str) -> Dict[str, float]:
    """What a prepare cannot avoid, alone: the claim GET and two fsynced file writes."""
    started = now()
    await client.get_resource_claim("bench", name)
    await client.get_pod("bench", "p")
    got = now() - started
    path = os.path.join(root, "parts", "file.json")
    started = now()
    for _ in range(2):
        write_atomic(path, "{}\n", mode=0o644, durable=True, make_dirs=True)
    return {"get": got, "writes": now() - started}


def run(ctx: Context) -> List[Figure]:
    return asyncio.run(_measure(ctx))
