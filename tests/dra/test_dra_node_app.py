"""The host process with DRA resources: a device-plugin resource and a DRA resource side by
side in one HostApp, start-up checks that exit 2, and plugin-watcher device plugins."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from device_plugin_host_testing.drivers import MemoryDriver, make_devices
from device_plugin_host_testing.harness import make_config
from host.app import HostApp
from host.core.model import Health, ResourceConfig
from host.dra import naming
from host.dra.kube import KubeClient
from host.dra.startup import DraStartError
from host.sim.apiserver import ApiServerStandIn, kube_api
from host.sim.kubelet import KubeletSimulator
from host.sim.kubelet_dra import DraKubeletSimulator, PrepareError

__all__ = ["kube_api"]

NODE = "node-1"
REPO = Path(__file__).resolve().parents[2]
DP = ResourceConfig(name="example.com/nic", driver="memory")
DRA = ResourceConfig(name="example.com/gpu", driver="memory", api="dra")
WATCHED = ResourceConfig(name="example.com/fpga", driver="memory",
                         registration="plugin-watcher")


def _config(root: str, api, *resources: ResourceConfig, **host):
    dirs = dict(node_name=NODE, kubeconfig=api.kubeconfig_path,
                plugins_registry_dir=os.path.join(root, "registry"),
                dra_plugins_dir=os.path.join(root, "plugins"),
                dra_state_dir=os.path.join(root, "state"), cdi_dir=os.path.join(root, "cdi"),
                drain_file=os.path.join(root, "drain", "drained"), rescan_interval_s=0)
    dirs.update(host)
    return make_config(os.path.join(root, "dp"), resources, **dirs)


def _driver() -> MemoryDriver:
    return MemoryDriver(devices={DP.name: make_devices("nic", 2),
                                 DRA.name: make_devices("gpu", 3),
                                 WATCHED.name: make_devices("fpga", 1)})


def test_device_plugin_and_dra_side_by_side_in_one_process(short_dir, run, kube_api, caplog):
    caplog.set_level(logging.INFO, logger="host.app")
    kube_api.add_node(NODE)
    config = _config(short_dir, kube_api, DP, DRA, WATCHED)
    os.makedirs(config.host.plugin_dir)
    driver = _driver()
    dra_driver = naming.driver_name(DRA.name, None)

    async def body():
        dp_kubelet = KubeletSimulator(config.host.plugin_dir)
        await dp_kubelet.start()
        client = KubeClient.from_settings(kube_api.kubeconfig_path)
        dra_kubelet = DraKubeletSimulator(
            config.host.plugins_registry_dir, get_claim=client.get_resource_claim,
            node_name=NODE, wipe_slices=kube_api.delete_slices_of_node)
        await dra_kubelet.start()
        app = HostApp(config, {"memory": driver}, events=None)
        await app.start()
        try:
            assert app.served() == [DP.name]  # kubelet.sock registrations only
            await dp_kubelet.wait_for(lambda k: DP.name in k.resources
                                      and k.resources[DP.name].snapshots, what="nic")
            await dra_kubelet.wait_registered(dra_driver)
            await dra_kubelet.wait_registered(WATCHED.name, plugin_type="DevicePlugin")
            await dra_kubelet.watcher.wait_for(
                lambda w: bool(dra_kubelet.device_plugins[WATCHED.name].snapshots),
                what="the plugin-watcher device plugin's stream")
            await app.ready.wait()
            [ready] = [m for m in caplog.messages if "resources registered" in m]
            assert ready.startswith("all 3 resources registered (2 device-plugin, 1 DRA), ")
            # the slices, read back from the API server
            assert await app.dra.publisher.wait_synced()
            published = kube_api.devices(dra_driver, NODE)
            assert sorted(published) == ["gpu0", "gpu1", "gpu2"]
            [piece] = kube_api.resource_slices(dra_driver, NODE)
            assert piece["spec"]["pool"]["name"] == naming.pool_name(DRA.name, NODE)
            # the DRA resource is not a device plugin, and vice versa
            assert DRA.name not in dp_kubelet.resources
            pod = str(uuid.uuid4())
            claim = kube_api.put_resource_claim({
                "metadata": {"name": "c", "namespace": "default"},
                "spec": {"devices": {"requests": [
                    {"name": "gpu", "exactly": {"deviceClassName": "gpu"}}]}},
                "status": {"allocation": {"devices": {"results": [
                    {"request": "gpu", "driver": dra_driver,
                     "pool": naming.pool_name(DRA.name, NODE), "device": "gpu1"}]}},
                    "reservedFor": [{"resource": "pods", "name": "p", "uid": pod}]}})
            [info] = await dra_kubelet.prepare(pod, [("default", "c")])
            assert info.devices[dra_driver][0].device_name == "gpu1"
            assert [c.uid for c in app.dra.frontend.prepared_claims()] == [claim["metadata"]["uid"]]
            sample = app.metrics.registry.get_sample_value
            labels = {"driver": dra_driver, "outcome": "prepared"}
            assert sample("device_plugin_host_dra_claims_total", labels) == 1
            assert sample("device_plugin_host_dra_prepared_claims") == 1
            assert sample("device_plugin_host_dra_call_duration_seconds_count",
                          {"driver": dra_driver, "call": "prepare"}) == 1
            # a hot-plug reaches the DRA pool and the slice through the same inventory
            driver.devices[DRA.name] = make_devices("gpu", 4)
            await app.rescan(["memory"])
            assert "gpu3" in app.dra.frontend.pools[DRA.name].by_name
            assert await app.dra.publisher.wait_synced()
            assert sorted(kube_api.devices(dra_driver, NODE)) == ["gpu0", "gpu1", "gpu2", "gpu3"]
            # health: an Unhealthy device leaves the slice, and comes back
            sick = make_devices("gpu", 4)
            sick[2] = sick[2].with_health(Health.UNHEALTHY, "link down")
            driver.devices[DRA.name] = sick
            await app.rescan(["memory"])
            assert await app.dra.publisher.wait_synced()
            assert sorted(kube_api.devices(dra_driver, NODE)) == ["gpu0", "gpu1", "gpu3"]
            driver.devices[DRA.name] = make_devices("gpu", 4)
            await app.rescan(["memory"])
            assert await app.dra.publisher.wait_synced()
            assert "gpu2" in kube_api.devices(dra_driver, NODE)
            # a kubelet restart wipes the node's slices; our re-registration republishes
            await dra_kubelet.restart(wipe_sockets=True)
            assert kube_api.devices(dra_driver, NODE) == {}
            await dra_kubelet.wait_registered(dra_driver)
            await _until(lambda: app.dra.frontend.all_registered())
            assert await app.dra.publisher.wait_synced()
            assert len(kube_api.devices(dra_driver, NODE)) == 4
            [again] = await dra_kubelet.prepare(pod, [("default", "c")])
            assert again.devices[dra_driver][0].device_name == "gpu1"
            await dra_kubelet.unprepare(pod)
            assert app.dra.frontend.prepared_claims() == []
        finally:
            await app.stop()
            await dra_kubelet.stop()
            await dp_kubelet.stop()
            await client.close()
        assert os.listdir(config.host.plugins_registry_dir) == []

    run(body())


def test_start_up_checks_fail_before_serving(short_dir, run, monkeypatch):
    monkeypatch.delenv("NODE_NAME", raising=False)
    with ApiServerStandIn() as api:
        async def start(config):
            app = HostApp(config, {"memory": _driver()}, events=None)
            try:
                await app.start()
            finally:
                await app.stop()

        config = _config(short_dir, api, DRA)
        no_name = dataclasses.replace(config, host=dataclasses.replace(config.host,
                                                                       node_name=""))
        with pytest.raises(DraStartError, match="NODE_NAME"):
            run(start(no_name))
        bad_name = dataclasses.replace(config, host=dataclasses.replace(config.host,
                                                                        node_name="Node_1"))
        with pytest.raises(DraStartError, match=r"'Node_1'.*not a valid Node name"):
            run(start(bad_name))
        api.add_node(NODE)
        api.set_node_status(NODE, {DRA.name: "3"}, {DRA.name: "3"})  # a device plugin's
        with pytest.raises(DraStartError, match="both APIs"):
            run(start(config))
        api.set_node_status(NODE, {DRA.name: "0"}, {DRA.name: "0"})
        api.fail_next(403, verbs={"get"})
        with pytest.raises(DraStartError, match=r"no API access.*403"):
            run(start(config))
        assert not os.path.exists(config.host.plugins_registry_dir) or not os.listdir(
            config.host.plugins_registry_dir)


def test_an_api_server_outage_at_start_is_not_fatal(short_dir, run):
    """Down at start: the host serves anyway; the slices arrive once the server answers."""
    with ApiServerStandIn() as api:
        api.add_node(NODE)
        config = _config(short_dir, api, DRA)
        dra_driver = naming.driver_name(DRA.name, None)
        api.stop()

        async def body():
            async with _PluginWatcher(config, api) as kubelet:
                app = HostApp(config, {"memory": _driver()}, events=None)
                await app.start()
                try:
                    assert DRA.name in app.dra.frontend.pools
                    await kubelet.wait_registered(dra_driver)
                    api.start()
                    assert await app.dra.publisher.wait_synced(timeout_s=20)
                    assert sorted(api.devices(dra_driver, NODE)) == ["gpu0", "gpu1", "gpu2"]
                finally:
                    await app.stop()

        run(body())


def test_cli_exits_2_with_one_line_when_dra_cannot_start(short_dir, tmp_path):
    config = tmp_path / "config.toml"
    config.write_text(
        f'[host]\nplugins_registry_dir = "{short_dir}/r"\ndra_plugins_dir = "{short_dir}/p"\n'
        f'metrics_address = ""\ndrain_file = "{short_dir}/d/drained"\n'
        '[[resource]]\nname = "example.com/gpu"\ndriver = "gpu"\napi = "dra"\n')
    (tmp_path / "sys").mkdir()  # a host root must have sys/ (else that is the exit 2)
    env = {k: v for k, v in os.environ.items() if k != "NODE_NAME"}
    result = subprocess.run(
        [sys.executable, "-m", "host", "run", "--config", str(config), "--plugin-dir",
         short_dir, "--host-root", str(tmp_path)],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=60)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if "cannot serve DRA" in line]
    assert len(lines) == 1 and "NODE_NAME" in lines[0]
    assert "Traceback" not in result.stderr


class _PluginWatcher:
    """The kubelet's plugin watcher, registering our DRA drivers: a pool is published only
    once the kubelet has accepted its driver."""

    def __init__(self, config, api) -> None:
        self.client = KubeClient.from_settings(api.kubeconfig_path)
        self.kubelet = DraKubeletSimulator(config.host.plugins_registry_dir, node_name=NODE,
                                           get_claim=self.client.get_resource_claim)

    async def __aenter__(self) -> DraKubeletSimulator:
        await self.kubelet.start()
        return self.kubelet

    async def __aexit__(self, *exc) -> None:
        await self.kubelet.stop()
        await self.client.close()


async def _until(predicate, timeout: float = 5.0) -> None:
    """For a state that arrives as a gRPC call on this loop (NotifyRegistrationStatus)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.005)


def test_reload_moves_a_resource_between_the_apis_and_renames_a_driver(short_dir, run,
                                                                      kube_api):
    kube_api.add_node(NODE)
    config = _config(short_dir, kube_api, DP, DRA)
    os.makedirs(config.host.plugin_dir)
    old_driver = naming.driver_name(DRA.name, None)

    async def body():
        dp_kubelet = KubeletSimulator(config.host.plugin_dir)
        await dp_kubelet.start()
        client = KubeClient.from_settings(kube_api.kubeconfig_path)
        dra_kubelet = DraKubeletSimulator(config.host.plugins_registry_dir,
                                          get_claim=client.get_resource_claim, node_name=NODE)
        await dra_kubelet.start()
        app = HostApp(config, {"memory": _driver()}, events=None)
        await app.start()
        try:
            await dra_kubelet.wait_registered(old_driver)
            renamed = dataclasses.replace(DRA, dra_driver_name="gpu.example.com")
            moved = dataclasses.replace(DP, api="dra")
            await app.reload(dataclasses.replace(config, resources=(moved, renamed)))
            await dra_kubelet.wait_registered("gpu.example.com",
                                              naming.driver_name(DP.name, None))
            await dra_kubelet.watcher.wait_for(lambda w: w.by_name("DRAPlugin", old_driver)
                                               is None, what="the old driver deregistered")
            assert app.served() == []
            assert await app.dra.publisher.wait_synced()
            assert sorted(kube_api.devices("gpu.example.com", NODE)) == ["gpu0", "gpu1", "gpu2"]
            assert kube_api.devices(old_driver, NODE) == {}
            assert sorted(kube_api.devices(naming.driver_name(DP.name, None), NODE)) == [
                "nic0", "nic1"]
        finally:
            await app.stop()
            await dra_kubelet.stop()
            await dp_kubelet.stop()
            await client.close()

    run(body())


def test_slices_wiped_after_the_host_went_away_come_back_with_it(short_dir, run, kube_api):
    """The kubelet deletes a driver's slices wipingDelay after its last plugin is gone (the
    host stopped for longer than that); the host publishes them again when it returns, and
    one that returns in time keeps them."""
    kube_api.add_node(NODE)
    config = _config(short_dir, kube_api, DRA)
    dra_driver = naming.driver_name(DRA.name, None)

    async def body():
        client = KubeClient.from_settings(kube_api.kubeconfig_path)
        kubelet = DraKubeletSimulator(
            config.host.plugins_registry_dir, get_claim=client.get_resource_claim,
            node_name=NODE, kube=client, wiping_delay_s=0.0)
        await kubelet.start()
        try:
            app = HostApp(config, {"memory": _driver()}, events=None)
            await app.start()
            await kubelet.wait_registered(dra_driver)
            assert await app.dra.publisher.wait_synced()
            assert len(kube_api.devices(dra_driver, NODE)) == 3
            await app.stop()  # its registration socket goes: deregistered, wiped
            await kubelet.watcher.wait_for(lambda w: kubelet.wiped_drivers == [dra_driver],
                                           what="the driver's slices wiped")
            assert kube_api.devices(dra_driver, NODE) == {}
            kubelet.wiping_delay_s = 30.0  # now a restart that comes back in time
            app = HostApp(config, {"memory": _driver()}, events=None)
            await app.start()
            try:
                await kubelet.wait_registered(dra_driver)
                assert await app.dra.publisher.wait_synced()
                assert len(kube_api.devices(dra_driver, NODE)) == 3
            finally:
                await app.stop()
            app = HostApp(config, {"memory": _driver()}, events=None)
            await app.start()
            try:
                await kubelet.wait_registered(dra_driver)
                assert kubelet.wiped_drivers == [dra_driver]  # the pending wipe was cancelled
                assert len(kube_api.devices(dra_driver, NODE)) == 3
            finally:
                await app.stop()
        finally:
            await kubelet.stop()
            await client.close()

    run(body())


def test_host_process_restart_keeps_prepared_claims_and_their_cdi_specs(short_dir, run,
                                                                        kube_api):
    kube_api.add_node(NODE)
    config = _config(short_dir, kube_api, DRA)
    dra_driver = naming.driver_name(DRA.name, None)

    async def body():
        client = KubeClient.from_settings(kube_api.kubeconfig_path)
        kubelet = DraKubeletSimulator(config.host.plugins_registry_dir,
                                      get_claim=client.get_resource_claim, node_name=NODE)
        await kubelet.start()
        try:
            app = HostApp(config, {"memory": _driver()}, events=None)
            await app.start()
            pod = str(uuid.uuid4())
            kube_api.put_resource_claim({
                "metadata": {"name": "c", "namespace": "default"},
                "spec": {"devices": {"requests": [
                    {"name": "gpu", "exactly": {"deviceClassName": "gpu"}}]}},
                "status": {"allocation": {"devices": {"results": [
                    {"request": "gpu", "driver": dra_driver,
                     "pool": naming.pool_name(DRA.name, NODE), "device": "gpu0"}]}},
                    "reservedFor": [{"resource": "pods", "name": "p", "uid": pod}]}})
            try:
                await kubelet.wait_registered(dra_driver)
                await kubelet.prepare(pod, [("default", "c")])
            finally:
                await app.stop()  # a running container still needs its claim's CDI spec
            specs = os.listdir(config.host.cdi_dir)
            assert len(specs) == 1 and specs[0].startswith("device-plugin-host-claim_")
            app = HostApp(config, {"memory": _driver()}, events=None)
            await app.start()
            try:
                await kubelet.wait_registered(dra_driver)
                await kubelet.unprepare(pod)
                assert os.listdir(config.host.cdi_dir) == []
            finally:
                await app.stop()
        finally:
            await kubelet.stop()
            await client.close()

    run(body())


def test_an_operator_drain_reaches_the_slice_the_health_stream_and_prepare(short_dir, run,
                                                                           kube_api):
    from host.core.drains import update_drains

    kube_api.add_node(NODE)
    config = _config(short_dir, kube_api, DRA)
    dra_driver = naming.driver_name(DRA.name, None)
    pool = naming.pool_name(DRA.name, NODE)

    async def body():
        client = KubeClient.from_settings(kube_api.kubeconfig_path)
        kubelet = DraKubeletSimulator(config.host.plugins_registry_dir,
                                      get_claim=client.get_resource_claim, node_name=NODE)
        await kubelet.start()
        app = HostApp(config, {"memory": _driver()}, events=None)
        await app.start()
        try:
            await kubelet.wait_registered(dra_driver)
            update_drains(config.host.drain_file, (DRA.name, "gpu1"), "RMA ticket 42")
            await kubelet.watcher.wait_for(
                lambda w: kubelet.health(dra_driver, pool, "gpu1")[0] == "Unhealthy",
                what="the drain in the health stream")
            assert kubelet.health(dra_driver, pool, "gpu1")[1].endswith("RMA ticket 42")
            assert await app.dra.publisher.wait_synced()
            assert sorted(kube_api.devices(dra_driver, NODE)) == ["gpu0", "gpu2"]
            pod = str(uuid.uuid4())
            kube_api.put_resource_claim({
                "metadata": {"name": "c", "namespace": "default"},
                "spec": {"devices": {"requests": [
                    {"name": "gpu", "exactly": {"deviceClassName": "gpu"}}]}},
                "status": {"allocation": {"devices": {"results": [
                    {"request": "gpu", "driver": dra_driver, "pool": pool,
                     "device": "gpu1"}]}},
                    "reservedFor": [{"resource": "pods", "name": "p", "uid": pod}]}})
            with pytest.raises(PrepareError, match="RMA ticket 42"):
                await kubelet.prepare(pod, [("default", "c")])
            update_drains(config.host.drain_file, (DRA.name, "gpu1"), None)
            await kubelet.watcher.wait_for(
                lambda w: kubelet.health(dra_driver, pool, "gpu1")[0] == "Healthy",
                what="the undrain in the health stream")
            [info] = await kubelet.prepare(pod, [("default", "c")])
            assert info.prepared
            await kubelet.unprepare(pod)
        finally:
            await app.stop()
            await kubelet.stop()
            await client.close()

    run(body())


def test_a_kubelet_start_wipe_that_lands_after_our_registration_is_repaired(short_dir, run,
                                                                            kube_api):
    """The real DRA manager wipes the node's slices in the background (Node GET, backoff
    from 1 s), racing the registrations: a wipe after our republish must not leave the node
    without slices."""
    kube_api.add_node(NODE)
    config = _config(short_dir, kube_api, DRA)
    dra_driver = naming.driver_name(DRA.name, None)
    wiped = []

    def wipe(node: str) -> int:
        count = kube_api.delete_slices_of_node(node)
        wiped.append(count)
        return count

    async def body():
        client = KubeClient.from_settings(kube_api.kubeconfig_path)
        kubelet = DraKubeletSimulator(
            config.host.plugins_registry_dir, get_claim=client.get_resource_claim,
            node_name=NODE, wipe_slices=wipe)
        await kubelet.start()
        app = HostApp(config, {"memory": _driver()}, events=None)
        await app.start()
        try:
            await kubelet.wait_registered(dra_driver)
            assert await app.dra.publisher.wait_synced()
            kubelet.startup_wipe_delay_s = 0.3
            await kubelet.restart(wipe_sockets=True)
            await kubelet.wait_registered(dra_driver)
            assert await app.dra.publisher.wait_synced()
            await _until(lambda: len(wiped) == 2)
            assert wiped[-1] == 1  # the wipe came after the republish and took our slice
            loop = asyncio.get_running_loop()
            assert await loop.run_in_executor(None, lambda: kube_api.wait_for(
                lambda a: len(a.devices(dra_driver, NODE)) == 3, 10))
        finally:
            await app.stop()
            await kubelet.stop()
            await client.close()

    run(body())


@pytest.mark.parametrize("keeps_taints", [True, False], ids=["gate-on", "gate-off"])
def test_dra_unhealthy_taint_taints_a_drained_device_where_the_server_keeps_taints(
        short_dir, run, keeps_taints):
    """[host] dra_unhealthy = "taint" (here set by a live reload of a host started with the
    default "omit"): a drained (Unhealthy) device stays in the slice with a NoSchedule taint
    carrying the reason; a server without DRADeviceTaints drops the taint, and then the
    device is left out, as by default, never published as usable."""
    from host.core.drains import update_drains

    with ApiServerStandIn(device_taints=keeps_taints) as api:
        api.add_node(NODE)
        config = _config(short_dir, api, DRA)
        assert config.host.dra_unhealthy == "omit"
        tainting = dataclasses.replace(
            config, host=dataclasses.replace(config.host, dra_unhealthy="taint"))
        dra_driver = naming.driver_name(DRA.name, None)

        async def body():
            async with _PluginWatcher(config, api) as kubelet:
                app = HostApp(config, {"memory": _driver()}, events=None)
                await app.start()
                try:
                    await kubelet.wait_registered(dra_driver)
                    update_drains(config.host.drain_file, (DRA.name, "gpu1"), "RMA ticket 42")
                    await app.rescan()
                    assert await app.dra.publisher.wait_synced()
                    omitted = api.devices(dra_driver, NODE)
                    await app.reload(tainting)
                    assert await app.dra.publisher.wait_synced()
                    return omitted, api.devices(dra_driver, NODE)
                finally:
                    await app.stop()

        omitted, devices = run(body())
    assert sorted(omitted) == ["gpu0", "gpu2"]
    if keeps_taints:
        assert sorted(devices) == ["gpu0", "gpu1", "gpu2"]
        [taint] = devices["gpu1"]["taints"]
        assert taint["effect"] == "NoSchedule" and "RMA-ticket-42" in taint["value"]
        assert not devices["gpu0"].get("taints")
    else:
        assert sorted(devices) == ["gpu0", "gpu2"]


def test_dra_unhealthy_from_the_config_file_reaches_the_publisher(short_dir, run, tmp_path):
    from host.config import load_config

    with ApiServerStandIn(device_taints=True) as api:
        api.add_node(NODE)
        path = tmp_path / "config.toml"
        path.write_text(f'[host]\nnode_name = "{NODE}"\nkubeconfig = "{api.kubeconfig_path}"\n'
                        'dra_unhealthy = "taint"\n')
        loaded = load_config(str(path), {"memory": _driver()})
        config = _config(short_dir, api, DRA, dra_unhealthy=loaded.host.dra_unhealthy)

        async def body():
            app = HostApp(config, {"memory": _driver()}, events=None)
            await app.start()
            try:
                return app.dra.publisher.taint_unhealthy
            finally:
                await app.stop()

        assert run(body()) is True


def test_healthz_fails_while_the_plugin_watcher_has_not_registered_our_dra_driver(short_dir,
                                                                                    run, caplog):
    """A host with only DRA resources: the kubelet is up (its kubelet.sock) but its plugin
    watcher never registers our driver; past the grace /healthz is 503 naming the driver, and
    200 again once a kubelet's plugin watcher registers it (and the host says its one
    resource is registered)."""
    caplog.set_level(logging.INFO, logger="host.app")
    import socket
    import urllib.error
    import urllib.request

    def healthz(address) -> tuple:
        try:
            with urllib.request.urlopen(f"http://{address[0]}:{address[1]}/healthz",
                                        timeout=10) as reply:
                return reply.status, reply.read().decode()
        except urllib.error.HTTPError as error:
            return error.code, error.read().decode()

    with ApiServerStandIn() as api:
        api.add_node(NODE)
        config = _config(short_dir, api, DRA, liveness_grace_s=1)
        dra_driver = naming.driver_name(DRA.name, None)
        os.makedirs(config.host.plugin_dir, exist_ok=True)
        kubelet_sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        kubelet_sock.bind(os.path.join(config.host.plugin_dir, "kubelet.sock"))
        kubelet_sock.listen()

        async def status_until(app: HostApp, wanted: int, what: str) -> str:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 15
            while True:
                status, text = await loop.run_in_executor(
                    None, healthz, app.metrics.address)
                if status == wanted:
                    return text
                assert loop.time() < deadline, f"{what}: still {status} {text!r}"
                await asyncio.sleep(0.1)

        async def body():
            app = HostApp(config, {"memory": _driver()}, events=None)
            assert await app.metrics.start("127.0.0.1:0") is not None
            client = KubeClient.from_settings(api.kubeconfig_path)
            kubelet = None
            try:
                await app.start()
                # no device plugin to hold against us
                assert app.device_plugin.registrar.endpoints == {}
                text = await status_until(app, 503, "a DRA driver nobody registers")
                assert f"DRA driver {dra_driver} has not been registered by the kubelet's " \
                       "plugin watcher" in text
                kubelet = DraKubeletSimulator(config.host.plugins_registry_dir,
                                              get_claim=client.get_resource_claim,
                                              node_name=NODE)
                await kubelet.start()
                await kubelet.wait_registered(dra_driver)
                assert await status_until(app, 200, "registered") == "ok\n"
                await app.ready.wait()
                [ready] = [m for m in caplog.messages if "resources registered" in m]
                assert ready.startswith("all 1 resources registered (0 device-plugin, 1 DRA)")
            finally:
                await app.stop()
                await app.metrics.stop()
                if kubelet is not None:
                    await kubelet.stop()
                await client.close()

        try:
            run(body())
        finally:
            kubelet_sock.close()


def test_a_pool_is_published_only_once_the_kubelet_has_registered_its_driver(short_dir, run):
    """The kubelet refuses to prepare a claim of an unregistered driver ("DRA driver ... is not
    registered") and retries with its pod worker's backoff: slices published before the
    plugin watcher accepted the driver let the scheduler place pods that then wait. Nothing is
    published until it has; then the pool at once."""
    with ApiServerStandIn() as api:
        api.add_node(NODE)
        config = _config(short_dir, api, DRA)
        dra_driver = naming.driver_name(DRA.name, None)

        async def body():
            app = HostApp(config, {"memory": _driver()}, events=None)
            await app.start()
            try:
                await asyncio.sleep(0.5)
                assert api.devices(dra_driver, NODE) == {}
                async with _PluginWatcher(config, api) as kubelet:
                    await kubelet.wait_registered(dra_driver)
                    registered = asyncio.get_running_loop().time()
                    assert await app.dra.publisher.wait_synced()
                    assert sorted(api.devices(dra_driver, NODE)) == ["gpu0", "gpu1", "gpu2"]
                    assert asyncio.get_running_loop().time() - registered < 1.0
            finally:
                await app.stop()

        run(body())
