"""The real host in its own process serving one DRA resource, for the NodePrepare figures.

    python -m benchmarks.draproc --kubeconfig K --root D --node N [--devices 8]

One resource ``example.com/dra-0`` with ``api = "dra"`` and ``--devices`` MemoryDriver
devices, and ``example.com/dra-shared`` with as many devices shared ``SHARES`` ways
(``replicas``, host.dra.sharing); the DRA sockets and the registration sockets live under
``D``, the checkpoint and CDI specs too. Prints ``ready`` once the plugin watcher (the
simulator in the benchmark process) registered the drivers; serves until SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import signal
import sys
from typing import List, Optional

from device_plugin_host_testing.drivers import MemoryDriver, make_devices
from device_plugin_host_testing.harness import make_config, running_host
from host.core.model import ResourceConfig

RESOURCE = "example.com/dra-0"
SHARED = "example.com/dra-shared"
SHARES = 4
DRIVER = "memory"


def dirs(root: str) -> dict:
    return {"plugins_registry_dir": os.path.join(root, "registry"),
            "dra_plugins_dir": os.path.join(root, "plugins"),
            "dra_state_dir": os.path.join(root, "state"), "cdi_dir": os.path.join(root, "cdi"),
            "drain_file": os.path.join(root, "drain", "drained")}


async def serve(kubeconfig: str, root: str, node: str, devices: int) -> None:
    os.makedirs(os.path.join(root, "drain"), exist_ok=True)
    os.makedirs(os.path.join(root, "dp"), exist_ok=True)
    driver = MemoryDriver(DRIVER, {RESOURCE: make_devices("dev", devices),
                                   SHARED: make_devices("shared", devices)})
    config = make_config(os.path.join(root, "dp"),
                         [ResourceConfig(RESOURCE, DRIVER, api="dra"),
                          ResourceConfig(SHARED, DRIVER, api="dra", replicas=SHARES)],
                         node_name=node, kubeconfig=kubeconfig, metrics_address="",
                         rescan_interval_s=0, **dirs(root))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    async with running_host(config, {DRIVER: driver}) as app:
        gc.freeze()  # as `cli run` does once the host has started
        app.on_ready.append(lambda: print("ready", flush=True))
        if app.ready.is_set():
            print("ready", flush=True)
        await stop.wait()


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.draproc")
    parser.add_argument("--kubeconfig", required=True)
    parser.add_argument("--root", required=True)
    parser.add_argument("--node", required=True)
    parser.add_argument("--devices", type=int, default=8)
    args = parser.parse_args(argv)
    asyncio.run(serve(args.kubeconfig, args.root, args.node, args.devices))
    return 0


if __name__ == "__main__":
    sys.exit(main())
