"""Moving a resource between the device plugin API and DRA on a running host, with pods
holding devices on both sides: the kubelet stand-in writes the Node's status as the kubelet's
node status sync does (and keeps a stopped plugin's capacity for its grace period), and a
watcher checks at every step that no name and no device is ever offered through both APIs."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Dict, List, Optional, Set

import pytest

from device_plugin_host_testing.drivers import MemoryDriver, make_devices
from device_plugin_host_testing.harness import make_config
from device_plugin_host_testing.node_status import NodeStatusSync
from host.app import HostApp
from host.core.model import ResourceConfig
from host.dra import naming, startup
from host.dra.kube import KubeClient, KubeError
from host.dra.startup import DraStartError, advertised
from host.kubelet.protocol import HEALTHY
from host.sim.apiserver import ApiServerStandIn, kube_api
from host.sim.kubelet import KubeletSimulator
from host.sim.kubelet_dra import DraKubeletSimulator

__all__ = ["kube_api"]

NODE = "node-1"
REPO = Path(__file__).resolve().parents[2]
GPU = ResourceConfig(name="example.com/gpu", driver="memory")
DRIVER = naming.driver_name(GPU.name, None)
POOL = naming.pool_name(GPU.name, NODE)
STATUS_S = 0.1  # node status sync period here (the kubelet's is 10 s)


def _config(root: str, api: Any, *resources: ResourceConfig):
    return make_config(
        os.path.join(root, "dp"), resources, node_name=NODE, kubeconfig=api.kubeconfig_path,
        plugins_registry_dir=os.path.join(root, "registry"),
        dra_plugins_dir=os.path.join(root, "plugins"), dra_state_dir=os.path.join(root, "state"),
        cdi_dir=os.path.join(root, "cdi"), drain_file=os.path.join(root, "drain", "drained"),
        pod_resources_socket=os.path.join(root, "pr", "kubelet.sock"), rescan_interval_s=0)


def _with_api(config, api_name: str):
    return dataclasses.replace(config, resources=tuple(
        dataclasses.replace(r, api=api_name) for r in config.resources))


class Watcher:
    """Samples the Node, the slices and the kubelet's device manager every few ms and records
    every moment a name or a device is offered through both APIs."""

    def __init__(self, client: KubeClient, kubelet: KubeletSimulator) -> None:
        self.client = client
        self.kubelet = kubelet
        self.violations: List[str] = []
        self.samples = 0
        self._task: Optional[asyncio.Task] = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        assert self._task is not None
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass
        assert self.samples > 10, self.samples

    async def _published(self) -> Set[str]:
        slices = await self.client.list_resource_slices(DRIVER, NODE)
        return {d["name"] for s in slices if s["spec"]["pool"]["name"] == POOL
                for d in s["spec"].get("devices") or []}

    def _device_plugin(self) -> Set[str]:
        state = self.kubelet.resources.get(GPU.name)
        if state is None or not state.live:
            return set()
        return {d.ID for d in state.snapshot if d.health == HEALTHY}

    async def _run(self) -> None:
        """Each sample reads the Node and the device manager before and after the slices:
        what is offered on both sides of a slice list was offered while it was read."""
        while True:
            try:
                node_before = await self.client.get_node(NODE)
                offered_before = self._device_plugin()
                published = await self._published()
                offered_after = self._device_plugin()
                node_after = await self.client.get_node(NODE)
            except KubeError:
                await asyncio.sleep(0.005)
                continue
            self.samples += 1
            if published and advertised(node_before, GPU.name) and advertised(
                    node_after, GPU.name):
                self.violations.append(f"Node lists {GPU.name} "
                                       f"({node_after['status']}) while slices offer {published}")
            both = published & offered_before & offered_after
            if both:
                self.violations.append(f"{both} offered through both APIs")
            await asyncio.sleep(0.005)


def _claim(api: Any, devices: List[str], pod_uid: str, name: str) -> Dict[str, Any]:
    return api.put_resource_claim({
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
            "deviceClassName": "gpu", "count": len(devices)}}]}},
        "status": {"allocation": {"devices": {"results": [
            {"request": "gpu", "driver": DRIVER, "pool": POOL, "device": d}
            for d in devices]}},
            "reservedFor": [{"resource": "pods", "name": name, "uid": pod_uid}]},
    })


async def _until(predicate, what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


async def _pods(config) -> str:
    """`device-plugin-host pods` as an operator runs it on the node."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "host", "pods", "--socket", config.host.pod_resources_socket,
        "--dra-state-dir", config.host.dra_state_dir, cwd=REPO,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out, _ = await process.communicate()
    assert process.returncode == 0, out
    return out.decode()


def test_moving_a_resource_both_ways_with_pods_holding_devices(short_dir, run, kube_api):
    kube_api.add_node(NODE)
    config = _config(short_dir, kube_api, GPU)
    os.makedirs(config.host.plugin_dir)
    driver = MemoryDriver(devices={GPU.name: make_devices("gpu", 3)})

    async def body():
        kubelet = KubeletSimulator(config.host.plugin_dir,
                                   pod_resources_socket=config.host.pod_resources_socket)
        await kubelet.start()
        # Slower than in the other test: the Node lags the device manager by up to this
        # (10 s in the kubelet), the window in which publishing would offer the name twice.
        status = NodeStatusSync(kubelet, kube_api, NODE, interval_s=0.5)
        status.start()
        client = KubeClient.from_settings(kube_api.kubeconfig_path)
        dra_kubelet = DraKubeletSimulator(
            config.host.plugins_registry_dir, get_claim=client.get_resource_claim,
            node_name=NODE, wipe_slices=kube_api.delete_slices_of_node)
        await dra_kubelet.start()
        app = HostApp(config, {"memory": driver}, events=None)
        watcher = Watcher(client, kubelet)
        await app.start()
        try:
            assert not app.dra.started  # no DRA resource at start: built by the move
            await _until(lambda: status.written.get(GPU.name) == "3", "Node capacity 3")
            await kubelet.allocate(GPU.name, 1, pod="dp-pod")
            held = kubelet.in_use(GPU.name)
            watcher.start()

            # device plugin -> DRA
            to_dra = _with_api(config, "dra")
            await app.start_dra_live(to_dra)
            await app.reload(to_dra)
            assert app.moves.blocked(GPU.name)
            await app.moves.wait_idle(30)
            assert not kubelet.resources[GPU.name].connected
            assert not advertised(await client.get_node(NODE), GPU.name)
            await _until(lambda: len(kube_api.devices(DRIVER, NODE)) == 2, "2 published")
            # the device the device-plugin pod holds stays out until it is released
            assert set(kube_api.devices(DRIVER, NODE)) == {"gpu0", "gpu1", "gpu2"} - held
            assert "moving" not in app.moves.serving()[GPU.name]
            assert "held through device-plugin" in app.moves.serving()[GPU.name]
            shown = await _pods(config)
            assert f"{GPU.name}  dra (1 device(s) still held through device-plugin: " in shown
            assert "dp-pod" in shown  # the PodResources table, as before
            kubelet.release("dp-pod")
            await _until(lambda: len(kube_api.devices(DRIVER, NODE)) == 3, "the released one")
            await dra_kubelet.wait_registered(DRIVER)

            # a pod holds a device through DRA
            pod_uid = str(uuid.uuid4())
            _claim(kube_api, ["gpu1"], pod_uid, "dra-pod")
            await dra_kubelet.prepare(pod_uid, [("default", "dra-pod")])

            # DRA -> device plugin
            await app.reload(config)
            await app.moves.wait_idle(30)
            assert not [s for s in kube_api.resource_slices(DRIVER, NODE)
                        if s["spec"]["pool"]["name"] == POOL]
            await kubelet.wait_for(lambda k: k.resources[GPU.name].live
                                   and k.resources[GPU.name].allocatable == 2,
                                   what="two devices through the device plugin")
            assert set(kubelet.resources[GPU.name].devices) == {"gpu0", "gpu2"}
            # the driver stays registered while its claim is prepared, so it can be unprepared
            assert dra_kubelet.registered(DRIVER)
            await dra_kubelet.unprepare(pod_uid)
            await kubelet.wait_for(lambda k: k.resources[GPU.name].allocatable == 3,
                                   timeout=10, what="the unprepared device back")
            await _until(lambda: not dra_kubelet.registered(DRIVER), "the driver deregistered")
            await _until(lambda: status.written.get(GPU.name) == "3", "Node capacity 3 again")
            await watcher.stop()
            assert watcher.violations == []
            assert f"{GPU.name}  device-plugin\n" in await _pods(config)
            assert [(name, to) for name, to, _ in app.moves.finished] == [
                (GPU.name, "dra"), (GPU.name, "device-plugin")]
        finally:
            await app.stop()
            await status.stop()
            await dra_kubelet.stop()
            await kubelet.stop()
            await client.close()

    run(body(), timeout=90)


@contextlib.asynccontextmanager
async def _kubelets(config, api, grace_s: float, status_s: float):
    """The kubelet's device manager (``grace_s``: its endpoint stop grace), its node status
    sync every ``status_s`` and its plugin watcher for DRA drivers; yields (device manager,
    status sync, KubeClient)."""
    kubelet = KubeletSimulator(config.host.plugin_dir, endpoint_stop_grace_s=grace_s,
                               pod_resources_socket=config.host.pod_resources_socket)
    await kubelet.start()
    client = KubeClient.from_settings(api.kubeconfig_path)
    dra_kubelet = DraKubeletSimulator(config.host.plugins_registry_dir,
                                      get_claim=client.get_resource_claim, node_name=NODE)
    await dra_kubelet.start()
    status = NodeStatusSync(kubelet, api, NODE, interval_s=status_s)
    status.start()
    try:
        yield kubelet, status, client
    finally:
        await status.stop()
        await kubelet.stop()
        await dra_kubelet.stop()
        await client.close()


def test_a_stopped_device_plugin_s_capacity_is_waited_for_at_start(short_dir, run,
                                                                   monkeypatch):
    """The name still in the Node's capacity from a plugin that stopped (the kubelet keeps it
    for its grace period): the DRA host starts, waits, and publishes once it is gone; a
    plugin still serving it (allocatable > 0) after the status wait stops the start, exit 2."""
    monkeypatch.setattr(startup, "STILL_SERVING_WAIT_S", 0.5)
    with ApiServerStandIn() as api:
        api.add_node(NODE)
        config = _config(short_dir, api, GPU)
        os.makedirs(config.host.plugin_dir)
        driver = MemoryDriver(devices={GPU.name: make_devices("gpu", 3)})

        async def body():
            async with _kubelets(config, api, grace_s=1.5, status_s=STATUS_S) as (
                    kubelet, status, client):
                watcher = Watcher(client, kubelet)
                old = HostApp(config, {"memory": driver}, events=None)
                await old.start()
                await _until(lambda: status.written_allocatable.get(GPU.name) == "3", "served")
                dra = _with_api(config, "dra")
                early = HostApp(dra, {"memory": driver}, events=None)
                with pytest.raises(DraStartError, match="running device plugin"):
                    try:
                        await early.start()
                    finally:
                        await early.stop()
                await old.stop()  # no empty list: the kubelet keeps capacity 3, allocatable 0
                await _until(lambda: status.written_allocatable.get(GPU.name) == "0", "stopped")
                assert status.written[GPU.name] == "3"
                watcher.start()
                app = HostApp(dra, {"memory": driver}, events=None)
                started = time.monotonic()
                await app.start()
                try:
                    assert app.moves.blocked(GPU.name)
                    assert any("moving to dra" in line for line in app.metrics.notes())
                    await app.moves.wait_idle(10)
                    assert time.monotonic() - started >= 1.0  # the rest of the grace period
                    assert status.written[GPU.name] == "0"
                    await _until(lambda: len(api.devices(DRIVER, NODE)) == 3, "published")
                    await watcher.stop()
                    assert watcher.violations == []
                finally:
                    await app.stop()

        run(body(), timeout=60)


def test_a_device_plugin_stopped_just_before_the_start_is_waited_out(short_dir, run,
                                                                    monkeypatch):
    """A host replaced by one with api = "dra" (the DaemonSet's label move): the Node still
    shows the old plugin's allocatable until the kubelet's next status write. The new host
    re-reads the Node instead of exiting 2, then waits out the capacity and publishes; nothing
    is ever offered through both APIs."""
    monkeypatch.setattr(startup, "STILL_SERVING_WAIT_S", 10.0)
    with ApiServerStandIn() as api:
        api.add_node(NODE)
        config = _config(short_dir, api, GPU)
        os.makedirs(config.host.plugin_dir)
        driver = MemoryDriver(devices={GPU.name: make_devices("gpu", 3)})

        async def body():
            async with _kubelets(config, api, grace_s=1.0, status_s=1.0) as (  # a slow write
                    kubelet, status, client):
                watcher = Watcher(client, kubelet)
                old = HostApp(config, {"memory": driver}, events=None)
                await old.start()
                await _until(lambda: status.written_allocatable.get(GPU.name) == "3", "served")
                watcher.start()
                await old.stop()
                assert status.written_allocatable.get(GPU.name) == "3"  # not written yet
                app = HostApp(_with_api(config, "dra"), {"memory": driver}, events=None)
                try:
                    await app.start()
                    assert status.written_allocatable.get(GPU.name) == "0"
                    await app.moves.wait_idle(10)
                    await _until(lambda: len(api.devices(DRIVER, NODE)) == 3, "published")
                    await watcher.stop()
                    assert watcher.violations == []
                finally:
                    await app.stop()

        run(body(), timeout=60)
