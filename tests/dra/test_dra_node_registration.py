"""Plugin-watcher registration of our endpoints, against the simulated plugin watcher.

Real gRPC over real unix sockets in temp dirs; the watcher is written from upstream's
pkg/kubelet/pluginmanager (1 s GetInfo, the plugin's version order, retries with backoff).
"""

from __future__ import annotations

import asyncio
import os

import grpc

from device_plugin_host_testing.drivers import MemoryDriver, make_devices
from host.core.isolation import DriverCalls
from host.core.model import ResourceConfig
from host.kubelet.plugin_watcher import (
    PluginWatcherEndpoint,
    device_plugin_info,
    dra_plugin_info,
    registration_socket_name,
)
from host.kubelet.protocol import VERSION
from host.kubelet.protocol import pluginregistration_v1_pb2 as reg_api
from host.kubelet.service import DevicePluginService
from host.kubelet.snapshot import Snapshot
from host.sim.kubelet_dra import DraKubeletSimulator
from host.sim.kubelet_dra.watcher import PluginWatcher

DRIVER = "gpu.device-plugin-host.io"
SERVICES = ("v1.DRAPlugin", "v1beta1.DRAPlugin")


async def _no_claims(namespace: str, name: str) -> dict:
    raise AssertionError("registration tests never read a claim")


def _dirs(root: str):
    registry = os.path.join(root, "reg")
    plugins = os.path.join(root, "plugins")
    return registry, plugins


def _dra_endpoint(root: str, info=None) -> PluginWatcherEndpoint:
    """An endpoint serving an empty generic handler set is enough to register: the watcher
    never calls the DRA service."""
    registry, plugins = _dirs(root)
    endpoint = os.path.join(plugins, DRIVER, "dra.sock")
    return PluginWatcherEndpoint(info or dra_plugin_info(DRIVER, endpoint, SERVICES), registry,
                                 lambda generation: ())


def test_dra_plugin_registers_with_v1_first_and_dra_socket_before_registration(short_dir,
                                                                               run):
    registry, plugins = _dirs(short_dir)

    async def body():
        sim = DraKubeletSimulator(registry, get_claim=_no_claims, plugins_dir=plugins)
        await sim.start()
        endpoint = _dra_endpoint(short_dir)
        endpoint.start()
        try:
            await sim.wait_registered(DRIVER)
            plugin = sim.plugin(DRIVER)
            assert plugin.chosen_service == "v1.DRAPlugin"
            assert plugin.endpoint == os.path.join(plugins, DRIVER, "dra.sock")
            assert os.path.basename(plugin.socket_path) == f"{DRIVER}-reg.sock"
            await _until(lambda: endpoint.registered)
            dra = os.stat(endpoint.socket_path)
            reg = os.stat(endpoint.registration_path)
            assert dra.st_ctime_ns <= reg.st_ctime_ns, "the DRA socket must exist first"
            assert oct(dra.st_mode & 0o777) == "0o600"
        finally:
            await endpoint.close()
            await sim.stop()
        assert not os.path.exists(endpoint.registration_path)
        assert not os.path.exists(endpoint.socket_path)

    run(body())


def test_wiped_sockets_are_served_again_and_registered_again(short_dir, run):
    registry, plugins = _dirs(short_dir)

    async def body():
        sim = DraKubeletSimulator(registry, get_claim=_no_claims, plugins_dir=plugins)
        await sim.start()
        endpoint = _dra_endpoint(short_dir)
        endpoint.start()
        try:
            await sim.wait_registered(DRIVER)
            first = sim.plugin(DRIVER)
            os.unlink(endpoint.socket_path)  # the DRA socket: a fresh registration follows
            await sim.watcher.wait_for(
                lambda w: w.by_name("DRAPlugin", DRIVER) not in (None, first),
                what="registered again after the DRA socket was wiped")
            second = sim.plugin(DRIVER)
            os.unlink(endpoint.registration_path)  # deregisters; we serve it again
            await sim.watcher.wait_for(
                lambda w: w.by_name("DRAPlugin", DRIVER) not in (None, second),
                what="registered again after the registration socket was wiped")
            assert endpoint.registrations >= 3
        finally:
            await endpoint.close()
            await sim.stop()

    run(body())


def test_kubelet_restart_that_wipes_sockets(short_dir, run):
    registry, plugins = _dirs(short_dir)

    async def body():
        sim = DraKubeletSimulator(registry, get_claim=_no_claims, plugins_dir=plugins)
        await sim.start()
        endpoint = _dra_endpoint(short_dir)
        endpoint.start()
        try:
            await sim.wait_registered(DRIVER)
            for _ in range(3):
                before = endpoint.registrations
                await sim.restart(wipe_sockets=True)
                await sim.wait_registered(DRIVER)
                await _until(lambda b=before: endpoint.registrations > b)
            await sim.restart(wipe_sockets=False)  # the walk at start finds the socket
            await sim.wait_registered(DRIVER)
        finally:
            await endpoint.close()
            await sim.stop()

    run(body())


def test_versions_the_kubelet_does_not_know_are_refused_and_reported(short_dir, run):
    registry, plugins = _dirs(short_dir)

    async def body():
        watcher = PluginWatcher(registry)
        await watcher.start()
        bad = dra_plugin_info(DRIVER, os.path.join(plugins, DRIVER, "dra.sock"), ["1.0.0"])
        endpoint = _dra_endpoint(short_dir, bad)
        endpoint.start()
        try:
            await watcher.wait_for(lambda w: bool(w.errors), what="a refused registration")
            await _until(lambda: endpoint.last_error is not None)
            assert "none of services supported by the plugin" in endpoint.last_error
            assert not watcher.plugins and not endpoint.registered
        finally:
            await endpoint.close()
            await watcher.stop()

    run(body())


def test_get_info_slower_than_one_second_never_registers(short_dir, run):
    registry, _ = _dirs(short_dir)
    path = os.path.join(registry, registration_socket_name("slow.example.com"))

    class Slow(grpc.GenericRpcHandler):
        def service(self, details):
            async def get_info(request, context):
                await asyncio.sleep(1.5)
                return reg_api.PluginInfo(type="DRAPlugin", name="slow.example.com",
                                          supported_versions=["v1.DRAPlugin"])
            if details.method.endswith("/GetInfo"):
                return grpc.unary_unary_rpc_method_handler(
                    get_info, request_deserializer=reg_api.InfoRequest.FromString,
                    response_serializer=reg_api.PluginInfo.SerializeToString)
            return None

    async def body():
        os.makedirs(registry, exist_ok=True)
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((Slow(),))
        server.add_insecure_port(f"unix://{path}")
        await server.start()
        watcher = PluginWatcher(registry)
        await watcher.start()
        try:
            await watcher.wait_for(lambda w: bool(w.errors), what="a GetInfo timeout")
            assert "DEADLINE_EXCEEDED" in watcher.errors[0]
            assert not watcher.plugins
        finally:
            await watcher.stop()
            await server.stop(0)

    run(body())


def test_device_plugin_through_the_plugin_watcher(short_dir, run):
    registry, plugins = _dirs(short_dir)
    resource = ResourceConfig(name="example.com/widget", driver="memory")
    driver = MemoryDriver(devices={resource.name: make_devices("w", 2)})

    async def body():
        snapshot = Snapshot()
        snapshot.update(driver.devices[resource.name])
        calls = DriverCalls()
        service = DevicePluginService(resource, driver, snapshot, calls, allocate_timeout_s=5)
        socket = os.path.join(plugins, "example.com_widget", "device-plugin.sock")
        endpoint = PluginWatcherEndpoint(device_plugin_info(resource.name, socket, VERSION),
                                         registry, lambda g: (service.handler(g),))
        sim = DraKubeletSimulator(registry, get_claim=_no_claims)
        await sim.start()
        endpoint.start()
        try:
            await sim.wait_registered(resource.name, plugin_type="DevicePlugin")
            await sim.watcher.wait_for(
                lambda w: bool(sim.device_plugins.get(resource.name)
                               and sim.device_plugins[resource.name].snapshots),
                what="the first ListAndWatch snapshot")
            ids = [i for i, _ in sim.device_plugins[resource.name].snapshots[-1]]
            assert ids == ["w0", "w1"]
            snapshot.update(make_devices("w", 3))
            await sim.watcher.wait_for(
                lambda w: len(sim.device_plugins[resource.name].snapshots[-1]) == 3,
                what="the hot-plugged device streamed")
        finally:
            await endpoint.close()
            await sim.stop()
            calls.shutdown()

    run(body())


async def _until(predicate, timeout: float = 5.0) -> None:
    """Wait for a state change that arrives as a gRPC call on this loop."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError("condition not reached")
        await asyncio.sleep(0.005)
