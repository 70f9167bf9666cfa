"""The real host in its own process, with devices from memory, for process-level figures.

Memory, idle CPU and the RPC round trip are properties of a host *process* talking to another
process (the kubelet), so these benchmarks run the real HostApp here, with a MemoryDriver
holding ``--devices`` devices spread over ``--resources`` resources, against whatever kubelet
listens in ``--plugin-dir`` (the simulator in the benchmark process)::

    python -m benchmarks.hostproc --resources 64 --devices 10000 --plugin-dir D

Prints ``serving`` once every socket is up and ``ready`` once every resource is registered;
serves until SIGTERM/SIGINT, then removes its sockets and exits 0.

Of the test kit this process loads only the MemoryDriver: the host root is built by the
caller (``numa_root``, passed as ``--host-root``; built here only when none is given) and the
host is started as ``device_plugin_host_testing.harness.running_host`` does, whose module loads the
kubelet simulator only for ``kubelet_and_host``. No host process loads those, so its memory figures
do not count them.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import shutil
import signal
import sys
import tempfile
from typing import Dict, List, Optional

from device_plugin_host_testing.drivers import MemoryDriver, make_devices
from device_plugin_host_testing.harness import make_config, running_host
from host.config import Config
from host.core.model import Device, ResourceConfig
from host.memory import return_freed_heap
from host.triggers.events import EVENTS_AFTER_READY_S

DRIVER = "memory"


def resource_name(index: int) -> str:
    return f"example.com/mem-{index}"


def device_prefix(index: int) -> str:
    return f"r{index}d"


def build_devices(resources: int, devices: int, numa_nodes: int) -> Dict[str, List[Device]]:
    """``devices`` devices in all, as even as possible over the resources (the first ones get
    the remainder), each resource's devices in blocks over the NUMA nodes."""
    per, extra = divmod(devices, resources)
    numa = tuple(range(numa_nodes))
    return {
        resource_name(i): make_devices(device_prefix(i), per + (1 if i < extra else 0), numa)
        for i in range(resources)
    }


def numa_root(path: str, numa_nodes: int) -> str:
    """A host root with ``numa_nodes`` NUMA nodes and nothing else, for ``--host-root``."""
    from host.sim.tree import FakeTree

    FakeTree(path).numa_nodes(max(1, numa_nodes))
    return path


def bench_config(plugin_dir: str, resources: List[ResourceConfig], host_root: str,
                 state_dir: str) -> Config:
    """The harness config, with the operator drain file in a directory that exists (as a
    DaemonSet's hostPath makes it): a missing one is watched through its nearest ancestor,
    and on a shared /tmp every file anyone creates there would wake the host."""
    drain_dir = os.path.join(state_dir, "device-plugin-host")
    os.makedirs(drain_dir, exist_ok=True)
    return make_config(plugin_dir, resources, host_root=host_root,
                       drain_file=os.path.join(drain_dir, "drained"))


async def serve(resources: int, devices: int, plugin_dir: str, host_root: str,
                numa_nodes: int, state_dir: str, events: Optional[str] = None) -> None:
    table = build_devices(resources, devices, numa_nodes)
    driver = MemoryDriver(DRIVER, table)
    driver.subsystems = ("pci", "usb", "net", "infiniband", "drm")  # every watch armed
    config = bench_config(plugin_dir, [ResourceConfig(name, DRIVER) for name in table],
                          host_root, state_dir)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    async with running_host(config, {DRIVER: driver}, events=events) as app:
        gc.freeze()  # as `cli run` does once the host has started

        def armed() -> None:
            if events and app.events.source is None:
                print("event source failed to start", file=sys.stderr, flush=True)
                stop.set()
                return
            print("ready", flush=True)

        def ready() -> None:
            # As `cli run` does half a second after all are registered (host/cli/serve.py; there
            # are no other drivers to load here): the freed heap of that burst goes back.
            loop.call_later(0.5, return_freed_heap)
            # The kernel's event monitor is armed a moment after every resource registered
            # (host/triggers/events.py DeviceEvents.arm); "ready" means registered and watching.
            delay = EVENTS_AFTER_READY_S + 0.05 if events else 0.0
            loop.call_later(delay, armed)

        app.on_ready.append(ready)
        print("serving", flush=True)
        if app.ready.is_set():
            ready()
        await stop.wait()


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.hostproc")
    parser.add_argument("--resources", type=int, default=64)
    parser.add_argument("--devices", type=int, default=10_000)
    parser.add_argument("--plugin-dir", required=True)
    parser.add_argument("--numa-nodes", type=int, default=2)
    parser.add_argument("--host-root", help="default: a fake tree with --numa-nodes nodes")
    parser.add_argument("--events", choices=["udev"], help="arm the kernel uevent monitor")
    args = parser.parse_args(argv)
    if args.resources < 1 or args.devices < 0:
        parser.error("--resources must be at least 1 and --devices not negative")
    state = tempfile.mkdtemp(prefix="dphb-host-")
    root = args.host_root
    if root is None:
        root = numa_root(os.path.join(state, "root"), args.numa_nodes)
    try:
        asyncio.run(serve(args.resources, args.devices, args.plugin_dir, root,
                          args.numa_nodes, state, args.events))
    finally:
        shutil.rmtree(state, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
