"""Moving a resource between the device plugin API and DRA on a running host.

Setup: the real HostApp in this process with one resource of 8 MemoryDriver devices, the
kubelet stand-in with its PodResources socket, the API-server stand-in (real HTTP), and the
kubelet's node status sync (``device_plugin_host_testing.node_status``) writing the Node every
``STATUS_S``: the real kubelet's period is 10 s, which would only measure that period. The
resource is moved back and forth with ``start_dra_live`` + ``reload`` (what a reloaded file
does).

Figure ``migrate_ms_to_dra``: from the reload until the API server holds the pool's slice
(empty list sent, endpoint stopped, the Node's status without the name, slice published).
Floor: the least any correct move needs here, the same stand-ins and client: write the Node's
status without the name (as the sync does), see it on a Node watch, create a slice of the
same devices.

Figure ``migrate_ms_to_device_plugin``: from the reload until the kubelet stand-in has the
resource live with its 8 devices (pool withdrawn, no slice of it left on the server, served
and registered). Floor: delete the slice, list to see it gone, and a hand-written minimal
plugin's Register with its first ListAndWatch message (``floors.MinimalPlugin``). Moves and
floors alternate, so drift hits both.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import os
from typing import Dict, List

from benchmarks.core import Context, Figure, median, now, percentile, short_dir
from benchmarks.floors import MinimalPlugin, kubelet_channel
from device_plugin_host_testing.drivers import MemoryDriver, make_devices
from device_plugin_host_testing.harness import make_config
from device_plugin_host_testing.node_status import NodeStatusSync
from host.app import HostApp
from host.core.model import ResourceConfig
from host.dra.kube import KubeClient
from host.dra.naming import driver_name, pool_name
from host.dra.node import NodeWatch
from host.dra.slices import build_slices
from host.kubelet.protocol.convert import framed_device, snapshot_payload
from host.sim.apiserver import ApiServerStandIn
from host.sim.kubelet import KubeletSimulator
from host.sim.kubelet_dra import DraKubeletSimulator

KEYS = ("migrate_ms_to_dra", "migrate_ms_to_device_plugin")
NODE = "bench-node"
RESOURCE = "example.com/gpu"
FLOOR_RESOURCE = "example.com/floor"
DRIVER = driver_name(RESOURCE, None)
POOL = pool_name(RESOURCE, NODE)
DEVICES = 8
STATUS_S = 0.02


async def _until(check, timeout_s: float = 30.0) -> None:
    deadline = now() + timeout_s
    while not check():
        if now() > deadline:
            raise RuntimeError("timed out")
        await asyncio.sleep(0.001)


async def _measure(moves: int) -> Dict[str, List[float]]:
    out: Dict[str, List[float]] = {k: [] for k in ("dra", "dp", "dra_floor", "dp_floor")}
    devices = make_devices("gpu", DEVICES)
    with short_dir() as root, ApiServerStandIn() as api:
        api.add_node(NODE)
        plugin_dir = os.path.join(root, "dp")
        os.makedirs(plugin_dir)
        config = make_config(
            plugin_dir, [ResourceConfig(name=RESOURCE, driver="memory")], node_name=NODE,
            kubeconfig=api.kubeconfig_path, plugins_registry_dir=os.path.join(root, "reg"),
            dra_plugins_dir=os.path.join(root, "plugins"),
            dra_state_dir=os.path.join(root, "state"), cdi_dir=os.path.join(root, "cdi"),
            drain_file=os.path.join(root, "drain", "drained"),
            pod_resources_socket=os.path.join(root, "pr.sock"), rescan_interval_s=0,
            metrics_address="")
        to_dra = dataclasses.replace(config, resources=tuple(
            dataclasses.replace(r, api="dra") for r in config.resources))
        kubelet = KubeletSimulator(plugin_dir,
                                   pod_resources_socket=config.host.pod_resources_socket)
        await kubelet.start()
        status = NodeStatusSync(kubelet, api, NODE, interval_s=STATUS_S)
        status.start()
        client = KubeClient.from_settings(api.kubeconfig_path)
        # The kubelet's plugin watcher: a moved pool is published once it has registered
        # the DRA driver, which each move to DRA includes (the driver deregisters with its
        # last pool on the way back).
        dra_kubelet = DraKubeletSimulator(config.host.plugins_registry_dir,
                                          get_claim=client.get_resource_claim, node_name=NODE)
        await dra_kubelet.start()
        app = HostApp(config, {"memory": MemoryDriver(devices={RESOURCE: devices})},
                      events=None)
        floor_watch = NodeWatch(client, NODE, lambda uid: None)
        floor_watch.start()
        floor_slice = build_slices("floor.device-plugin-host.io", NODE, "floor-pool", devices,
                                   1, api.add_node(NODE)["metadata"]["uid"])[0]
        payload = snapshot_payload(framed_device(d) for d in devices)
        channel = kubelet_channel(plugin_dir)
        await app.start()
        try:
            await app.start_dra_live(to_dra)
            await _until(lambda: status.written.get(RESOURCE) == str(DEVICES))
            for i in range(moves):
                started = now()
                await app.reload(to_dra)
                await _until(lambda: len(api.devices(DRIVER, NODE)) == DEVICES)
                out["dra"].append((now() - started) * 1000)

                # floor: the Node's status without a name, seen on a watch; one slice written
                started = now()
                await asyncio.to_thread(api.set_node_status, NODE, {FLOOR_RESOURCE: "0"},
                                        {FLOOR_RESOURCE: str(i)})
                mark = str(i)
                await floor_watch.wait_for_node(
                    lambda node, mark=mark: (node or {}).get("status", {}).get(
                        "allocatable", {}).get(FLOOR_RESOURCE) == mark)
                created = await client.create_resource_slice(copy.deepcopy(floor_slice))
                out["dra_floor"].append((now() - started) * 1000)

                started = now()
                await app.reload(config)
                await kubelet.wait_for(lambda k: k.resources[RESOURCE].live
                                       and k.resources[RESOURCE].allocatable == DEVICES,
                                       timeout=30, what="served again")
                out["dp"].append((now() - started) * 1000)

                # floor: the slice deleted and seen gone; a minimal plugin registered
                plugin = MinimalPlugin(plugin_dir, FLOOR_RESOURCE, i, payload)
                started = now()
                await client.delete_resource_slice(created["metadata"]["name"])
                await client.list_resource_slices("floor.device-plugin-host.io", NODE)
                await plugin.register(channel)
                await kubelet.wait_for(lambda k: k.resources[FLOOR_RESOURCE].live
                                       and k.resources[FLOOR_RESOURCE].allocatable == DEVICES,
                                       timeout=30, what="floor plugin")
                out["dp_floor"].append((now() - started) * 1000)
                await plugin.stop()
        finally:
            await app.stop()
            await floor_watch.close()
            await status.stop()
            await channel.close()
            await kubelet.stop()
            await dra_kubelet.stop()
            await client.close()
    return out


async def _figures(ctx: Context) -> List[Figure]:
    moves = ctx.pick(30, 10, 2)
    ctx.progress(f"migration: {moves} moves each way")
    samples = await _measure(moves)
    figures = []
    for key, ours, floor, what in (
            ("migrate_ms_to_dra", "dra", "dra_floor",
             "floor: a Node status write seen on a watch + 1 slice create"),
            ("migrate_ms_to_device_plugin", "dp", "dp_floor",
             "floor: 1 slice delete + 1 list + a minimal plugin's Register and first "
             "ListAndWatch")):
        if ctx.wants(key):
            figures.append(Figure(
                key, median(samples[ours]), "ms", median(samples[floor]),
                [f"p99 {percentile(samples[ours], 99):.1f} ms, {moves} moves; node status "
                 f"sync every {STATUS_S * 1000:.0f} ms (the kubelet's: 10 s); {what}"]))
    return figures


def run(ctx: Context) -> List[Figure]:
    return asyncio.run(_figures(ctx))
