"""Metrics scraped over real HTTP from a running host, after real allocations through the
kubelet simulator (which also serves PodResources, the source of ``allocated_device``).

The real HostApp is wired to HostMetrics; the test swaps in its own instance only to shorten
the PodResources List interval.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Dict, FrozenSet, Optional, Tuple

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from device_plugin_host_testing.drivers import MemoryDriver, make_devices
from device_plugin_host_testing.harness import make_config
from host import __version__
from host.app import HostApp
from host.core.model import Device, Health, ResourceConfig
from host.kubelet.liveness import RegistrationLiveness
from host.kubelet.protocol import api
from host.metrics import LATENCY_BUCKETS, HostMetrics, parse_address
from host.sim.kubelet import KubeletSimulator
from host.sim.kubelet.podresources import TokenBucket
from host.sim.tree import FakeTree

P = "device_plugin_host_"
GPU = "example.com/gpu"
NIC = "example.com/nic"
Samples = Dict[Tuple[str, FrozenSet[Tuple[str, str]]], float]


# -- scraping ---------------------------------------------------------------------------------
def _get(url: str, method: str = "GET", accept: Optional[str] = None) -> Tuple[int, str, str]:
    request = urllib.request.Request(url, method=method)
    if accept:
        request.add_header("Accept", accept)
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return reply.status, reply.headers["Content-Type"], reply.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.headers["Content-Type"], error.read().decode()


async def scrape(metrics: HostMetrics, path: str = "/metrics", **kw) -> Tuple[int, str, str]:
    assert metrics.address is not None
    host, port = metrics.address
    host = f"[{host}]" if ":" in host else host
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(None, lambda: _get(f"http://{host}:{port}{path}", **kw))


async def samples(metrics: HostMetrics) -> Samples:
    status, content_type, text = await scrape(metrics)
    assert status == 200 and content_type.startswith("text/plain")
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return out


def value(found: Samples, name: str, **labels: str) -> Optional[float]:
    return found.get((P + name, frozenset(labels.items())))


def series(found: Samples, name: str) -> Dict[FrozenSet[Tuple[str, str]], float]:
    return {labels: v for (n, labels), v in found.items() if n == P + name}


class Node:
    def __init__(self, plugin_dir: str, host_root: str, *, with_pod_resources: bool = True,
                 list_interval: float = 0.0):
        FakeTree(host_root).numa_nodes(2)
        self.pod_socket = os.path.join(plugin_dir, "pod-resources", "kubelet.sock")
        self.driver = MemoryDriver("mem", {GPU: make_devices("gpu", 4, (0, 1)),
                                           NIC: make_devices("nic", 2, ())})
        self.config = make_config(plugin_dir, [ResourceConfig(GPU, "mem"),
                                               ResourceConfig(NIC, "mem")], host_root=host_root)
        self.sim = KubeletSimulator(
            plugin_dir, pod_resources_socket=self.pod_socket if with_pod_resources else None)
        self.metrics = HostMetrics(pod_resources_socket=self.pod_socket,
                                   pod_list_min_interval_s=list_interval)
        # The test's instance: a fast List interval.
        self.app = HostApp(self.config, {"mem": self.driver}, events=None, metrics=self.metrics)

    async def __aenter__(self) -> Node:
        await self.sim.start()
        assert await self.metrics.start("127.0.0.1:0") is not None
        await self.app.start()
        await self.sim.wait_for(
            lambda k: k.resources[GPU].allocatable == 4 and k.resources[NIC].allocatable == 2,
            what="both resources registered")
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.app.stop()
        await self.metrics.stop()
        await self.sim.stop()


# -- end to end ------------------------------------------------------------------------------
def test_scrape_after_real_allocations(short_dir, tmp_path, run):
    async def scenario():
        async with Node(short_dir, str(tmp_path / "root")) as node:
            sim = node.sim
            await sim.allocate(GPU, 2, pod="train", container="trainer")
            await sim.allocate(NIC, 1, pod="infer", namespace="team-a", container="server")
            with pytest.raises(grpc.aio.AioRpcError):
                await sim.call_allocate(GPU, [["no-such-gpu"]])
            found = await samples(node.metrics)

            assert value(found, "devices", resource=GPU, health="Healthy") == 4
            assert value(found, "devices", resource=GPU, health="Unhealthy") == 0
            assert value(found, "devices", resource=NIC, health="Healthy") == 2
            assert value(found, "allocations_total", resource=GPU, outcome="ok") == 1
            assert value(found, "allocations_total", resource=GPU, outcome="refused") == 1
            assert value(found, "allocations_total", resource=NIC, outcome="ok") == 1
            assert value(found, "registrations_total", resource=GPU) == 1
            assert value(found, "registrations_total", resource=NIC) == 1
            assert value(found, "kubelet_restarts_total") == 0
            assert value(found, "driver_errors_total", driver="mem") == 0
            last_ok = node.app.inventory.status["mem"].last_ok
            assert value(found, "driver_last_success_timestamp_seconds", driver="mem") == last_ok
            assert value(found, "build_info", version=__version__,
                         python=next(dict(k)["python"] for k in series(found, "build_info")))
            assert value(found, "pod_resources_up") == 1

            held = {(pod, res): ids for _ns, pod, _c, res, ids in sim.allocations}
            expected = {
                frozenset({"resource": GPU, "device": d, "pod": "train", "namespace": "default",
                           "container": "trainer"}.items()): 1.0
                for d in held[("train", GPU)]
            }
            expected[frozenset({"resource": NIC, "device": held[("infer", NIC)][0],
                                "pod": "infer", "namespace": "team-a",
                                "container": "server"}.items())] = 1.0
            assert series(found, "allocated_device") == expected

            # A released pod leaves the metric on the next scrape.
            sim.release("train")
            found = await samples(node.metrics)
            assert {dict(k)["pod"] for k in series(found, "allocated_device")} == {"infer"}

    run(scenario())


def test_allocate_latency_is_observed_on_the_real_path(short_dir, tmp_path, run):
    async def scenario():
        async with Node(short_dir, str(tmp_path / "root")) as node:
            await node.sim.allocate(GPU, 1, pod="a")
            await node.sim.allocate(GPU, 1, pod="b")
            found = await samples(node.metrics)
            assert value(found, "allocate_duration_seconds_count", resource=GPU) == 2
            assert 0 < value(found, "allocate_duration_seconds_sum", resource=GPU) < 5

    run(scenario())


def test_kubelet_restart_driver_failure_and_health(short_dir, tmp_path, run):
    async def scenario():
        async with Node(short_dir, str(tmp_path / "root")) as node:
            await node.sim.restart()
            await node.sim.wait_for(
                lambda k: k.resources[GPU].registrations == 2
                and k.resources[NIC].registrations == 2 and k.resources[GPU].allocatable == 4,
                what="both resources registered again")
            await asyncio.sleep(0.05)  # the registered callbacks run right after Register
            found = await samples(node.metrics)
            assert value(found, "kubelet_restarts_total") == 1
            assert value(found, "registrations_total", resource=GPU) == 2

            node.driver.fail = RuntimeError("sysfs went away")
            await node.app.rescan()
            found = await samples(node.metrics)
            assert value(found, "driver_errors_total", driver="mem") == 1
            assert value(found, "devices", resource=GPU, health="Unhealthy") == 4
            assert value(found, "devices", resource=GPU, health="Healthy") == 0
            stamp = value(found, "driver_last_success_timestamp_seconds", driver="mem")

            node.driver.fail = None
            devices = make_devices("gpu", 4, (0, 1))
            devices[3] = devices[3].with_health(Health.UNHEALTHY, "ECC errors")
            node.driver.devices[GPU] = devices
            await node.app.rescan()
            found = await samples(node.metrics)
            assert value(found, "driver_errors_total", driver="mem") == 1
            assert value(found, "devices", resource=GPU, health="Healthy") == 3
            assert value(found, "devices", resource=GPU, health="Unhealthy") == 1
            assert value(found, "driver_last_success_timestamp_seconds", driver="mem") > stamp

    run(scenario())


def test_without_a_pod_resources_socket_the_pod_metric_is_empty(short_dir, tmp_path, run):
    async def scenario():
        node = Node(short_dir, str(tmp_path / "root"), with_pod_resources=False)
        async with node:
            await node.sim.allocate(GPU, 1, pod="p")
            status, _type, text = await scrape(node.metrics)
            assert status == 200
            found = await samples(node.metrics)
            assert series(found, "allocated_device") == {}
            assert value(found, "pod_resources_up") == 0
            assert value(found, "allocations_total", resource=GPU, outcome="ok") == 1
            assert f"# TYPE {P}allocated_device gauge" in text

    run(scenario())


def test_scrapes_close_together_share_one_list(short_dir, tmp_path, run):
    async def scenario():
        async with Node(short_dir, str(tmp_path / "root"), list_interval=60.0) as node:
            await node.sim.allocate(GPU, 1, pod="p")
            servicer = node.sim.pod_resources.servicer
            results = await asyncio.gather(*(samples(node.metrics) for _ in range(5)))
            results.append(await samples(node.metrics))
            assert servicer.calls.get("List", 0) == 1
            assert all(len(series(r, "allocated_device")) == 1 for r in results)

    run(scenario())


def test_a_rate_limited_list_leaves_the_metric_empty(short_dir, tmp_path, run):
    async def scenario():
        async with Node(short_dir, str(tmp_path / "root")) as node:
            await node.sim.allocate(GPU, 1, pod="p")
            servicer = node.sim.pod_resources.servicer
            found = await samples(node.metrics)
            assert len(series(found, "allocated_device")) == 1

            servicer.limiter = TokenBucket(qps=0.0, burst=0)  # every call refused
            found = await samples(node.metrics)
            assert series(found, "allocated_device") == {}
            assert value(found, "pod_resources_up") == 0

            servicer.limiter = TokenBucket()
            found = await samples(node.metrics)
            assert len(series(found, "allocated_device")) == 1
            assert value(found, "pod_resources_up") == 1

    run(scenario())


# -- HostMetrics on its own -----------------------------------------------------------------
def _serving(body):
    async def scenario():
        metrics = HostMetrics()
        assert await metrics.start("127.0.0.1:0") is not None
        try:
            await body(metrics)
        finally:
            await metrics.stop()

    return scenario()


def test_observations_buckets_and_removal(run):
    async def body(metrics: HostMetrics) -> None:
        metrics.set_devices("a.com/x", [Device("x0"), Device("x1", Health.UNHEALTHY)])
        metrics.observe_allocate("a.com/x", 0.00004, "ok")
        metrics.observe_allocate("a.com/x", 0.003, "ok")
        metrics.observe_allocate("a.com/x", 7.0, "error")
        metrics.observe_allocate("a.com/x", None, "refused")
        metrics.observe_allocate("a.com/x", 0.001, "bogus")  # unknown outcome: an error
        metrics.registered("a.com/x")
        metrics.driver_scan("d", False)
        metrics.driver_scan("d", True, when=1234.5)
        metrics.kubelet_restarts_seen(2)
        metrics.kubelet_restarts_seen(3)
        metrics.kubelet_restarts_seen(3)  # a running total: only news count
        found = await samples(metrics)
        assert value(found, "devices", resource="a.com/x", health="Healthy") == 1
        assert value(found, "devices", resource="a.com/x", health="Unhealthy") == 1
        assert value(found, "allocations_total", resource="a.com/x", outcome="ok") == 2
        assert value(found, "allocations_total", resource="a.com/x", outcome="error") == 2
        assert value(found, "allocations_total", resource="a.com/x", outcome="refused") == 1
        assert value(found, "allocate_duration_seconds_count", resource="a.com/x") == 4
        buckets = {dict(k)["le"]: v for k, v in series(found, "allocate_duration_seconds_bucket")
                   .items()}
        assert float(min(buckets, key=float)) == LATENCY_BUCKETS[0] == 0.00005
        assert buckets["5e-05"] == 1 and buckets["0.001"] == 2 and buckets["0.005"] == 3
        assert buckets["5.0"] == 3 and buckets["+Inf"] == 4
        assert value(found, "registrations_total", resource="a.com/x") == 1
        assert value(found, "driver_errors_total", driver="d") == 1
        assert value(found, "driver_last_success_timestamp_seconds", driver="d") == 1234.5
        assert value(found, "kubelet_restarts_total") == 3

        metrics.remove_resource("a.com/x")
        metrics.remove_resource("never.com/seen")  # harmless
        found = await samples(metrics)
        assert not [k for k in found if ("resource", "a.com/x") in k[1]]
        assert value(found, "kubelet_restarts_total") == 3

    run(_serving(body))


def test_allocate_observer_sorts_refusals_from_failures(run):
    class Refusal(Exception):
        def __init__(self, code: grpc.StatusCode) -> None:
            self.code = code

    async def body(metrics: HostMetrics) -> None:
        observe = metrics.allocate_observer
        observe("r", "allocated", object())
        observe("r", "allocated", object(), 0.002)
        observe("r", "refused", Refusal(grpc.StatusCode.INVALID_ARGUMENT))
        observe("r", "refused", Refusal(grpc.StatusCode.FAILED_PRECONDITION))
        observe("r", "refused", Refusal(grpc.StatusCode.DEADLINE_EXCEEDED), 5.1)
        observe("r", "refused", Refusal(grpc.StatusCode.INTERNAL))
        found = await samples(metrics)
        assert value(found, "allocations_total", resource="r", outcome="ok") == 2
        assert value(found, "allocations_total", resource="r", outcome="refused") == 2
        assert value(found, "allocations_total", resource="r", outcome="error") == 2
        assert value(found, "allocate_duration_seconds_count", resource="r") == 2

    run(_serving(body))


def test_sync_drivers_counts_each_error_once():
    class Status:
        def __init__(self, errors: int, last_ok: Optional[float]) -> None:
            self.errors, self.last_ok = errors, last_ok

    metrics = HostMetrics()
    metrics.sync_drivers({"gpu": Status(0, 10.0), "usb": Status(2, None)})
    metrics.sync_drivers({"gpu": Status(1, 10.0), "usb": Status(2, None)})
    metrics.sync_drivers({"gpu": Status(1, 20.0), "usb": Status(3, None)})
    get = metrics.registry.get_sample_value
    assert get(P + "driver_errors_total", {"driver": "gpu"}) == 1
    assert get(P + "driver_errors_total", {"driver": "usb"}) == 3
    assert get(P + "driver_last_success_timestamp_seconds", {"driver": "gpu"}) == 20.0
    assert get(P + "driver_last_success_timestamp_seconds", {"driver": "usb"}) is None


def test_hosts_in_one_process_keep_their_own_registries():
    first, second = HostMetrics(), HostMetrics()
    first.set_devices("a.com/x", [Device("x0")])
    assert first.registry.get_sample_value(
        P + "devices", {"resource": "a.com/x", "health": "Healthy"}) == 1
    assert second.registry.get_sample_value(
        P + "devices", {"resource": "a.com/x", "health": "Healthy"}) is None
    second.kubelet_restart()
    assert first.registry.get_sample_value(P + "kubelet_restarts_total") == 0
    assert second.registry.get_sample_value(P + "kubelet_restarts_total") == 1


def test_http_paths_methods_and_openmetrics(run):
    async def body(metrics: HostMetrics) -> None:
        assert (await scrape(metrics, "/"))[0] == 200
        assert (await scrape(metrics, "/nope"))[0] == 404
        assert (await scrape(metrics, "/metrics", method="POST"))[0] == 405
        status, _type, text = await scrape(metrics, "/metrics", method="HEAD")
        assert status == 200 and text == ""
        status, content_type, text = await scrape(
            metrics, "/metrics?x=1", accept="application/openmetrics-text; version=1.0.0")
        assert status == 200 and content_type.startswith("application/openmetrics-text")
        assert text.endswith("# EOF\n") and f"{P}build_info" in text

    run(_serving(body))


def test_garbage_and_silent_clients_do_not_stop_the_server(run):
    async def body(metrics: HostMetrics) -> None:
        host, port = metrics.address
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(b"NONSENSE\r\n\r\n")
        await writer.drain()
        assert (await reader.read()).startswith(b"HTTP/1.1 400 ")
        writer.close()
        # A client that connects and says nothing holds no scrape up.
        idle = await asyncio.open_connection(host, port)
        assert (await scrape(metrics))[0] == 200
        idle[1].close()

    run(_serving(body))


def test_address_forms_and_ipv6(run):
    assert parse_address("") is None
    assert parse_address("127.0.0.1:9400") == ("127.0.0.1", 9400)
    assert parse_address("[::1]:9400") == ("::1", 9400)
    assert parse_address(":9400") == (None, 9400)
    for bad in ("9400", "::1:9400", "[::1]", "host:port", "h:70000", "[]:1"):
        with pytest.raises(ValueError):
            parse_address(bad)

    if not socket.has_ipv6:
        return

    async def scenario():
        metrics = HostMetrics()
        try:
            bound = await metrics.start("[::1]:0")
        except OSError:  # pragma: no cover - the kernel without IPv6 at all
            return
        try:
            if bound is None:
                return  # no ::1 on this machine (IPv6 disabled): nothing to test
            assert bound[0] == "::1"
            assert (await scrape(metrics))[0] == 200
        finally:
            await metrics.stop()

    run(scenario())


def test_a_taken_port_or_no_address_disables_without_raising(run, caplog):
    async def scenario():
        holder = socket.socket()
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        try:
            metrics = HostMetrics()
            with caplog.at_level(logging.ERROR, logger="host.metrics"):
                assert await metrics.start(f"127.0.0.1:{port}") is None
                assert await metrics.start("nonsense") is None
            assert any(str(port) in r.getMessage() for r in caplog.records)
            assert await metrics.start("") is None
            await metrics.stop()  # stopping what never started is fine
        finally:
            holder.close()

    run(scenario())


# -- /healthz: the liveness probe's answer -----------------------------------------------------
def test_healthz_is_ok_while_the_loop_answers_and_the_check_is_clean(run):
    async def body(metrics: HostMetrics) -> None:
        assert await scrape(metrics, "/healthz") == (200, "text/plain; charset=utf-8", "ok\n")
        status, _type, text = await scrape(metrics, "/healthz", method="HEAD")
        assert status == 200 and text == ""
        metrics.liveness = lambda: ["resource example.com/x has not registered for 301 s"]
        status, _type, text = await scrape(metrics, "/healthz")
        assert status == 503
        assert text == "unhealthy: resource example.com/x has not registered for 301 s\n"
        metrics.liveness = lambda: []
        assert (await scrape(metrics, "/healthz"))[0] == 200

        def broken() -> list:
            raise RuntimeError("bug in the check")

        metrics.liveness = broken  # a bug in the check does not restart a working host
        status, _type, text = await scrape(metrics, "/healthz")
        assert status == 200 and "bug in the check" in text

    run(_serving(body))


def test_healthz_of_a_stuck_event_loop_times_out(run):
    """The loop itself answers, so a blocked loop answers nothing: the kubelet's probe fails
    by its timeoutSeconds. Here the loop sleeps 2 s in a callback; a 1 s client times out."""
    async def body(metrics: HostMetrics) -> None:
        host, port = metrics.address
        loop = asyncio.get_running_loop()
        started = threading.Event()

        def probe() -> str:
            started.wait(5)
            try:
                urllib.request.urlopen(f"http://{host}:{port}/healthz", timeout=1).read()
            except (socket.timeout, urllib.error.URLError, TimeoutError) as error:
                return f"timed out: {error}"
            return "answered"

        answer = loop.run_in_executor(None, probe)
        loop.call_soon(lambda: (started.set(), time.sleep(2)))
        assert (await answer).startswith("timed out")
        assert (await scrape(metrics, "/healthz"))[0] == 200  # the loop runs again

    run(_serving(body))


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _kubelet_socket(directory: str) -> socket.socket:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(os.path.join(directory, "kubelet.sock"))
    listener.listen()
    return listener


def test_registration_liveness_counts_only_while_the_kubelet_is_up(short_dir):
    clock = _Clock()
    state = {"example.com/a": False, "example.com/b": True}
    grace = [300.0]
    check = RegistrationLiveness(lambda: state, lambda: short_dir, lambda: grace[0], clock)
    assert check.problems() == []  # no kubelet.sock: nothing could register
    clock.now += 1000
    assert check.problems() == []
    kubelet = _kubelet_socket(short_dir)
    try:
        assert check.problems() == []  # the clock starts now
        clock.now += 299
        assert check.problems() == []
        clock.now += 2
        [problem] = check.problems()
        assert problem.startswith("resource example.com/a has not registered for 301 s")
        assert os.path.join(short_dir, "kubelet.sock") in problem
        grace[0] = 0  # disabled (a reload can change it)
        assert check.problems() == []
        grace[0] = 300
        state["example.com/a"] = True  # registered: its clock is reset
        assert check.problems() == []
        state["example.com/a"] = False
        clock.now += 299
        assert check.problems() == []
    finally:
        kubelet.close()
        os.unlink(os.path.join(short_dir, "kubelet.sock"))
    clock.now += 10
    assert check.problems() == []  # kubelet gone: nothing to hold against us
    (Path(short_dir) / "kubelet.sock").write_text("")  # a stale file is no kubelet
    clock.now += 1000
    assert check.problems() == []


def test_registration_liveness_holds_dra_drivers_to_the_same_grace(short_dir):
    clock = _Clock()
    resources = {"example.com/a": True}
    drivers = {"gpu.example.com": False, "nic.example.com": True}
    check = RegistrationLiveness(lambda: resources, lambda: short_dir, lambda: 300.0, clock,
                                 dra_registered=lambda: drivers)
    assert check.problems() == []  # no kubelet.sock: the plugin watcher is not there either
    kubelet = _kubelet_socket(short_dir)
    try:
        assert check.problems() == []  # the clock starts now
        clock.now += 299
        assert check.problems() == []
        clock.now += 2
        [problem] = check.problems()
        assert problem.startswith("DRA driver gpu.example.com has not been registered by the "
                                  "kubelet's plugin watcher for 301 s while the kubelet is up")
        assert "prepares none of its claims" in problem
        resources["example.com/a"] = False  # a device plugin that fell off: its own clock
        assert check.problems() == [problem]
        clock.now += 300
        assert [p.split()[0] for p in check.problems()] == ["DRA", "resource"]
        drivers["gpu.example.com"] = True  # registered: its clock is reset
        assert [p.split()[0] for p in check.problems()] == ["resource"]
        drivers["gpu.example.com"] = False
        clock.now += 299
        assert [p.split()[0] for p in check.problems()] == ["resource"]
    finally:
        kubelet.close()
        os.unlink(os.path.join(short_dir, "kubelet.sock"))
    assert check.problems() == []


async def _rejecting_kubelet(plugin_dir: str) -> grpc.aio.Server:
    """A kubelet that is up and refuses every Register (as one that rejects the resource)."""
    async def register(request: api.RegisterRequest, context) -> api.Empty:
        await context.abort(grpc.StatusCode.UNKNOWN, "registration refused for the test")

    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "v1beta1.Registration", {"Register": grpc.unary_unary_rpc_method_handler(
            register, request_deserializer=api.RegisterRequest.FromString,
            response_serializer=api.Empty.SerializeToString)}),))
    server.add_insecure_port("unix://" + os.path.join(plugin_dir, "kubelet.sock"))
    await server.start()
    return server


def test_healthz_fails_when_a_resource_cannot_register_while_the_kubelet_is_up(
        short_dir, tmp_path, run):
    FakeTree(tmp_path / "root").numa_nodes(2)
    driver = MemoryDriver("mem", {GPU: make_devices("gpu", 2, (0, 1))})
    config = make_config(short_dir, [ResourceConfig(GPU, "mem")],
                         host_root=str(tmp_path / "root"), liveness_grace_s=1)

    async def status_until(metrics: HostMetrics, wanted: int, what: str) -> str:
        deadline = time.monotonic() + 15
        while True:
            status, _type, text = await scrape(metrics, "/healthz")
            if status == wanted:
                return text
            assert time.monotonic() < deadline, f"{what}: still {status} {text!r}"
            await asyncio.sleep(0.1)

    async def scenario():
        kubelet = await _rejecting_kubelet(short_dir)
        app = HostApp(config, {"mem": driver}, events=None)
        assert await app.metrics.start("127.0.0.1:0") is not None
        sim = None
        try:
            await app.start()
            text = await status_until(app.metrics, 503, "a refused registration")
            assert f"resource {GPU} has not registered for" in text
            await kubelet.stop(None)  # the kubelet goes away: no reason to restart us
            if os.path.lexists(os.path.join(short_dir, "kubelet.sock")):
                os.unlink(os.path.join(short_dir, "kubelet.sock"))
            await status_until(app.metrics, 200, "the kubelet is gone")
            sim = KubeletSimulator(short_dir)  # a kubelet that accepts: registered, healthy
            await sim.start()
            await sim.wait_for(lambda k: GPU in k.resources and k.resources[GPU].connected,
                               what="registered with the new kubelet")
            assert (await scrape(app.metrics, "/healthz"))[0] == 200
        finally:
            await app.stop()
            await app.metrics.stop()
            if sim is not None:
                await sim.stop()
            await kubelet.stop(None)

    run(scenario())
