"""DRA: a device event until the API server holds the new ResourceSlices, and requests a change.

Setup: the API-server stand-in (``host.sim.apiserver``, real HTTP on 127.0.0.1, its own
thread and loop, upstream validation on every write) and the host's real ``SlicePublisher``
with ``KubeClient`` in this process, one pool of 8 devices (one slice) or of 300 (three). An
event flips one device's health, as a health check or hot-unplug does, so the pool changes and
every slice of it is written again with the next generation (the scheduler only uses slices
of a pool's newest generation).

Figure ``dra_slice_p99_ms_N``: from ``set_pool`` (what the app calls on the event) until the
stand-in has stored the last slice of the new generation (its ``on_write`` hook).
Floor: the same slices (same device count each, so the same JSON size and validation work)
written with bare ``update_resource_slice`` calls of the same client, one after the other,
timed the same way to the same hook; events and floors alternate, so drift hits both.

Figure ``dra_requests_per_change_N``: API requests the publisher sent per event, against the
least any publisher must send: one write per slice of the new generation.

Figure ``dra_slice_event_p99_ms``: a hot-plug, the same way: a pool of 8 GPUs gains a ninth
device, then loses it again, from ``set_pool`` until the stand-in stored the pool's slice;
floor: one bare update of a slice of the same size.

Figure ``dra_republish_p99_ms``: a kubelet start's wipe (DeleteCollection of the node's
slices, one DELETED event each, as the stand-in's ``delete_slices_of_node``) until every pool
is back: three pools (8 GPUs, 64 compute partitions of another driver, 16 NICs of a third),
timed from the wipe until the stand-in stored the last slice of the last pool. Only the
publisher's watch tells it (the wipe can land after our registration's republish). Floor:
the same slices of another node (a name as long, so the same sizes), wiped and created again
with bare ``create_resource_slice`` calls of the same client, one after the other, timed the
same way; wipes of both kinds alternate.
"""

from __future__ import annotations

import asyncio
import copy
from typing import Any, Dict, List, Sequence

from benchmarks.core import Context, Figure, median, now, percentile
from host.core.model import Device, Health
from host.dra.kube import KubeClient
from host.dra.naming import driver_name, pool_name
from host.dra.publisher import SlicePublisher
from host.dra.slices import build_slices
from host.sim.apiserver import ApiServerStandIn

KEYS = ("dra_slice_p99_ms_8", "dra_slice_p99_ms_300",
        "dra_requests_per_change_8", "dra_requests_per_change_300",
        "dra_slice_event_p99_ms", "dra_republish_p99_ms")
NODE = "bench-node"
RESOURCE = "example.com/gpu"
DRIVER = driver_name(RESOURCE, None)
POOL = pool_name(RESOURCE, NODE)
FLOOR_DRIVER = "floor.device-plugin-host.io"
FLOOR_NODE = "floor-node"  # as long as NODE: slices of the same size


def _devices(count: int, sick: int = -1) -> List[Device]:
    out = []
    for i in range(count):
        address = f"0000:{i // 32:02x}:{i % 32:02x}.0"
        out.append(Device(
            id=address, numa_nodes=(i % 2,),
            health=Health.UNHEALTHY if i == sick else Health.HEALTHY,
            health_reason="link down" if i == sick else "",
            attributes={"pci_address": address, "vendor": "0x10de", "device": "0x20b0",
                        "kernel_driver": "nvidia", "model": "NVIDIA A100-SXM4-40GB",
                        "device_minor": str(i), "pcie_root": f"pci0000:{i // 64:02x}",
                        "memory_bytes": str(40 << 30)}))
    return out


class _Arrivals:
    """Resolves a future once the stand-in stored ``want`` writes matching a test."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.future: Any = None
        self.match: Any = None
        self.left = 0
        self.at = 0.0

    def expect(self, match: Any, count: int) -> Any:
        self.future = self.loop.create_future()
        self.match, self.left = match, count
        return self.future

    def hook(self, verb: str, obj: Dict[str, Any]) -> None:  # the server's thread
        stamp = now()
        self.loop.call_soon_threadsafe(self._seen, obj, stamp)

    def _seen(self, obj: Dict[str, Any], stamp: float) -> None:
        if self.future is None or self.future.done() or not self.match(obj):
            return
        self.left -= 1
        if self.left == 0:
            self.at = stamp
            self.future.set_result(stamp)


async def _measure_pool(count: int, events: int, hot_plug: bool = False) -> Dict[str, Any]:
    api = ApiServerStandIn()
    api.start()
    loop = asyncio.get_running_loop()
    arrivals = _Arrivals(loop)
    client = KubeClient.from_settings(api.kubeconfig_path)
    publisher = SlicePublisher(client, NODE)
    try:
        api.add_node(NODE)
        publisher.set_pool(DRIVER, POOL, _devices(count))
        await publisher.start()
        if not await publisher.wait_synced(30):
            raise RuntimeError(f"the first publish did not complete: {publisher.last_error}")
        # The floor's own slices: the pool's shapes under another driver, created once.
        floor_slices: List[Dict[str, Any]] = []
        for obj in build_slices(FLOOR_DRIVER, NODE, POOL, _devices(count, sick=0), 1):
            floor_slices.append(await client.create_resource_slice(obj))
        api.on_write = arrivals.hook
        samples: List[float] = []
        floors: List[float] = []
        requests: List[int] = []
        minimum: List[int] = []
        for k in range(events):
            if hot_plug:  # a ninth device comes, then goes
                devices = _devices(count + 1 if k % 2 == 0 else count)
            else:
                sick = k % count if k % 2 == 0 else -1  # one device sick, then all healthy
                devices = _devices(count, sick)
            slices = len(build_slices(DRIVER, NODE, POOL, devices, 1))
            before = publisher.requests

            def ours(obj: Dict[str, Any]) -> bool:
                return obj.get("spec", {}).get("driver") == DRIVER

            done = arrivals.expect(ours, slices)
            start = now()
            publisher.set_pool(DRIVER, POOL, devices)
            await asyncio.wait_for(done, 10)
            samples.append((arrivals.at - start) * 1e3)
            if not await publisher.wait_synced(10):
                raise RuntimeError(f"publisher did not settle: {publisher.last_error}")
            requests.append(publisher.requests - before)
            minimum.append(slices)

            def theirs(obj: Dict[str, Any]) -> bool:
                return obj.get("spec", {}).get("driver") == FLOOR_DRIVER

            done = arrivals.expect(theirs, len(floor_slices))
            start = now()
            for i, obj in enumerate(floor_slices):
                body = copy.deepcopy(obj)
                body["spec"]["pool"]["generation"] += 1
                floor_slices[i] = await client.update_resource_slice(body)
            await asyncio.wait_for(done, 10)
            floors.append((arrivals.at - start) * 1e3)
        return {"samples": samples, "floors": floors, "requests": requests,
                "minimum": minimum, "slices": len(floor_slices)}
    finally:
        api.on_write = None
        await publisher.stop()
        await client.close()
        api.close()


def _figures(count: int, result: Dict[str, Any], events: int) -> Sequence[Figure]:
    samples, floors = result["samples"], result["floors"]
    per_change = sum(result["requests"]) / len(result["requests"])
    least = sum(result["minimum"]) / len(result["minimum"])
    return [
        Figure(f"dra_slice_p99_ms_{count}", percentile(samples, 99), "ms",
               percentile(floors, 99),
               [f"median {median(samples):.2f} ms (floor {median(floors):.2f} ms), {events} "
                f"events, {count} devices in {result['slices']} slice(s); floor: "
                f"{result['slices']} bare update(s) of slices of the same size"]),
        Figure(f"dra_requests_per_change_{count}", per_change, "requests", least,
               [f"max {max(result['requests'])}; least possible: one write per slice of the "
                "new generation"]),
    ]


#: The republish figure's node: (resource, device count) per pool, each its own driver.
REPUBLISH_POOLS = (("example.com/gpu", 8), ("example.com/partition", 64),
                   ("example.com/nic", 16))


async def _measure_republish(wipes: int) -> Dict[str, Any]:
    api = ApiServerStandIn()
    api.start()
    loop = asyncio.get_running_loop()
    arrivals = _Arrivals(loop)
    client = KubeClient.from_settings(api.kubeconfig_path)
    publisher = SlicePublisher(client, NODE)
    try:
        uid = api.add_node(NODE)["metadata"]["uid"]
        floor_uid = api.add_node(FLOOR_NODE)["metadata"]["uid"]
        # As the app runs it (host/outputs/dra.py): a NodeWatch follows the Node and hands
        # the publisher its uid, so a wipe's DELETED events do not make it read the Node.
        publisher.set_node_uid(uid)
        ours: List[Dict[str, Any]] = []
        theirs: List[Dict[str, Any]] = []
        for resource, count in REPUBLISH_POOLS:
            driver = driver_name(resource, None)
            publisher.set_pool(driver, pool_name(resource, NODE), _devices(count))
            ours.extend(build_slices(driver, NODE, pool_name(resource, NODE),
                                     _devices(count), 1, uid))
            theirs.extend(build_slices(driver, FLOOR_NODE, pool_name(resource, FLOOR_NODE),
                                       _devices(count), 1, floor_uid))
        await publisher.start()
        if not await publisher.wait_synced(30):
            raise RuntimeError(f"the first publish did not complete: {publisher.last_error}")
        for obj in theirs:
            await client.create_resource_slice(copy.deepcopy(obj))
        deadline = loop.time() + 10
        while api.watches == 0:  # the publisher's watch is what sees the wipe
            if loop.time() > deadline:
                raise RuntimeError("the publisher never opened its watch")
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.05)  # its first events (the current slices) are through
        api.on_write = arrivals.hook
        samples: List[float] = []
        floors: List[float] = []
        requests: List[int] = []

        def created_on(node: str) -> Any:
            def match(obj: Dict[str, Any]) -> bool:
                return obj.get("spec", {}).get("nodeName") == node
            return match

        for _ in range(wipes):
            before = publisher.requests
            done = arrivals.expect(created_on(NODE), len(ours))
            start = now()
            api.delete_slices_of_node(NODE)
            await asyncio.wait_for(done, 10)
            samples.append((arrivals.at - start) * 1e3)
            if not await publisher.wait_synced(10):
                raise RuntimeError(f"publisher did not settle: {publisher.last_error}")
            await asyncio.sleep(0.005)  # our own writes' events are through the watch
            requests.append(publisher.requests - before)

            done = arrivals.expect(created_on(FLOOR_NODE), len(theirs))
            start = now()
            api.delete_slices_of_node(FLOOR_NODE)
            for obj in theirs:
                await client.create_resource_slice(copy.deepcopy(obj))
            await asyncio.wait_for(done, 10)
            floors.append((arrivals.at - start) * 1e3)
        return {"samples": samples, "floors": floors, "requests": requests,
                "slices": len(ours)}
    finally:
        api.on_write = None
        await publisher.stop()
        await client.close()
        api.close()


def _republish_figure(result: Dict[str, Any], wipes: int) -> Figure:
    samples, floors = result["samples"], result["floors"]
    pools = ", ".join(f"{count} {resource.split('/')[1]}s"
                      for resource, count in REPUBLISH_POOLS)
    return Figure("dra_republish_p99_ms", percentile(samples, 99), "ms", percentile(floors, 99),
                  [f"median {median(samples):.2f} ms (floor {median(floors):.2f} ms), {wipes} "
                   f"wipes of {result['slices']} slices in 3 pools ({pools}); requests per "
                   f"wipe {sum(result['requests']) / len(result['requests']):.1f} (least: "
                   f"{result['slices']} creates); floor: {result['slices']} bare creates"])


async def _measure(ctx: Context) -> List[Figure]:
    figures: List[Figure] = []
    if ctx.wants("dra_slice_event_p99_ms"):
        events = ctx.pick(400, 100, 4)
        ctx.progress(f"DRA slices: hot-plug into a pool of 8, {events} events")
        result = await _measure_pool(8, events, hot_plug=True)
        samples, floors = result["samples"], result["floors"]
        figures.append(Figure(
            "dra_slice_event_p99_ms", percentile(samples, 99), "ms", percentile(floors, 99),
            [f"median {median(samples):.2f} ms (floor {median(floors):.2f} ms), {events} "
             "hot-plug events (a ninth device comes and goes); floor: 1 bare update"]))
    if ctx.wants("dra_republish_p99_ms"):
        wipes = ctx.pick(200, 50, 3)
        ctx.progress(f"DRA slices: kubelet wipes of 3 pools, {wipes} wipes")
        figures.append(_republish_figure(await _measure_republish(wipes), wipes))
    for count, events in ((8, ctx.pick(400, 100, 4)), (300, ctx.pick(200, 50, 2))):
        wanted = [k for k in (f"dra_slice_p99_ms_{count}", f"dra_requests_per_change_{count}")
                  if ctx.wants(k)]
        if not wanted:
            continue
        ctx.progress(f"DRA slices: {count} devices, {events} events")
        result = await _measure_pool(count, events)
        figures.extend(f for f in _figures(count, result, events) if f.key in wanted)
    return figures


def run(ctx: Context) -> List[Figure]:
    return asyncio.run(_measure(ctx))
