"""``device-plugin-host demo``: the real host, end to end, with no kubelet and no hardware.

It builds a sample host tree, starts the in-process kubelet simulator on a temporary plugin
directory, runs the real host (real drivers, real gRPC over unix sockets) with the built-in
default configuration against both, and shows what the kubelet would see and get.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
import tempfile
import time

from host.config import default_config
from host.plugins import load_drivers
from host.testing.harness import running_host
from host.testing.kubelet import KubeletSimulator
from host.testing.samples import build_demo_tree, demo_resources


def run_demo(keep: bool = False) -> int:
    workdir = tempfile.mkdtemp(prefix="dph-demo-")
    try:
        return asyncio.run(_demo(workdir))
    finally:
        if keep:
            print(f"\nkept {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


async def _demo(workdir: str) -> int:
    root = os.path.join(workdir, "host")
    plugin_dir = os.path.join(workdir, "device-plugins")
    build_demo_tree(root)
    registry = load_drivers()
    config = default_config(registry.drivers).with_overrides(plugin_dir=plugin_dir,
                                                             host_root=root)
    wanted = [r for r in demo_resources() if r.driver in registry.drivers]
    config = dataclasses.replace(config, resources=tuple(wanted), is_default=False)
    config = dataclasses.replace(config, host=dataclasses.replace(
        config.host, drain_file=os.path.join(workdir, "state", "drained"), metrics_address="",
        nfd_features_file=""))  # the demo's sample devices must never label a real node
    print(f"sample host tree: {root}")
    print(f"drivers loaded:   {', '.join(sorted(registry.drivers))}")
    for failure in registry.failures:
        print(f"driver failed:    {failure.source}: {failure.reason}")

    kubelet = KubeletSimulator(plugin_dir)
    await kubelet.start()
    try:
        started = time.monotonic()
        async with running_host(config, registry.drivers) as app:
            served = app.served()
            await kubelet.wait_for(
                lambda k: all(n in k.resources and k.resources[n].connected
                              and k.resources[n].snapshots for n in served),
                timeout=10, what="every resource registered",
            )
            elapsed = (time.monotonic() - started) * 1000
            print(f"\nregistered {len(served)} resources with the kubelet simulator "
                  f"in {elapsed:.0f} ms:")
            print(f"  {'RESOURCE':<27} {'SOCKET':<58} {'CAPACITY':>8} {'ALLOCATABLE':>11}")
            for name in sorted(served):
                state = kubelet.resources[name]
                print(f"  {name:<27} {state.endpoint:<58} {state.capacity:>8} "
                      f"{state.allocatable:>11}")

            resource = "nvidia.com/gpu"
            state = kubelet.resources[resource]
            topology = {
                d.ID: [n.ID for n in d.topology.nodes] for d in state.devices.values()
            }
            print(f"\n{resource} devices and NUMA nodes: {topology}")
            everything = sorted(state.devices)
            reply = await kubelet.call_preferred(resource, everything, [], 2)
            print(f"GetPreferredAllocation(size=2, available={len(everything)}): "
                  f"{list(reply.container_responses[0].deviceIDs)}")
            result = await kubelet.allocate(resource, 2, pod="demo-pod", container="cuda")
            print(f"Allocate for pod demo-pod: {result.device_ids} "
                  f"(NUMA nodes {sorted(result.numa_nodes)})")
            response = result.response
            for spec in response.devices:
                print(f"  device {spec.host_path} -> {spec.container_path} ({spec.permissions})")
            for key, value in sorted(response.envs.items()):
                print(f"  env    {key}={value}")
            for mount in response.mounts:
                print(f"  mount  {mount.host_path} -> {mount.container_path}")
            for resource, count in (("intel.com/sriov_netdevice", 2), ("example.com/zigbee", 1)):
                if resource not in kubelet.resources:
                    continue
                other = await kubelet.allocate(resource, count, pod="demo-pod", container="app")
                print(f"Allocate {resource} x{count}: {other.device_ids}")
                for key, value in sorted(other.response.envs.items()):
                    print(f"  env    {key}={value}")
                for spec in other.response.devices:
                    print(f"  device {spec.host_path} ({spec.permissions})")
    finally:
        await kubelet.stop()
    print("\ndemo finished: host stopped, sockets removed")
    return 0
