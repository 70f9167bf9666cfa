"""``device-plugin-host demo``: the real host, end to end, with no kubelet and no hardware.

It builds a sample host tree, starts the in-process kubelet simulator on a temporary plugin
directory, runs the real host (real drivers, real gRPC over unix sockets) with the built-in
default configuration against both, and shows what the kubelet would see and get. One
resource (the AMD GPUs) is served through DRA instead: an API-server stand-in receives its
ResourceSlice, and the DRA kubelet simulator prepares a claim for it, end to end.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
import tempfile
import time

from host.config import default_config
from host.config.plugins import load_drivers
from host.kubelet.socket_names import GRPC_MAX_SOCKET_PATH, longest_socket_path
from host.sim.kubelet import KubeletSimulator
from host.sim.running import running_host
from host.sim.samples import build_demo_tree, demo_resources


def _work_parent() -> str:
    """Where the demo's directory goes: the temp dir, unless its path would make the plugin
    directory too long for the host's socket names (a long TMPDIR); then /tmp."""
    parent = tempfile.gettempdir()
    plugin_dir = os.path.join(parent, "dph-demo-xxxxxxxx", "device-plugins")
    if longest_socket_path(plugin_dir) > GRPC_MAX_SOCKET_PATH and os.path.isdir("/tmp"):
        return "/tmp"
    return parent


def run_demo(keep: bool = False) -> int:
    workdir = tempfile.mkdtemp(prefix="dph-demo-", dir=_work_parent())
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
    wanted = [dataclasses.replace(r, api="dra") if r.name == DRA_RESOURCE else r
              for r in demo_resources() if r.driver in registry.drivers]
    config = dataclasses.replace(config, resources=tuple(wanted), is_default=False)
    from host.sim.apiserver import ApiServerStandIn

    api = ApiServerStandIn()
    api.start()
    api.add_node(DRA_NODE)
    config = dataclasses.replace(config, host=dataclasses.replace(
        config.host, drain_file=os.path.join(workdir, "state", "drained"), metrics_address="",
        nfd_features_file="",  # the demo's sample devices must never label a real node
        node_name=DRA_NODE, kubeconfig=api.kubeconfig_path,
        plugins_registry_dir=os.path.join(workdir, "plugins_registry"),
        dra_plugins_dir=os.path.join(workdir, "plugins"),
        dra_state_dir=os.path.join(workdir, "state", "dra"),
        cdi_dir=os.path.join(workdir, "cdi")))
    try:
        return await _serve(config, registry, api, root, plugin_dir)
    finally:
        api.close()


async def _serve(config, registry, api, root: str,
                 plugin_dir: str) -> int:
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
            if any(r.name == DRA_RESOURCE for r in config.resources):
                await _dra_demo(app, api, config)
    finally:
        await kubelet.stop()
    print("\ndemo finished: host stopped, sockets removed")
    return 0


DRA_RESOURCE = "amd.com/gpu"
DRA_NODE = "demo-node"


async def _dra_demo(app, api, config) -> None:
    """One DRA resource end to end: registration, slice, claim, prepare, CDI, unprepare."""
    import json

    from host.dra import naming
    from host.dra.kube import KubeClient
    from host.sim.kubelet_dra import DraKubeletSimulator

    driver = naming.driver_name(DRA_RESOURCE, None)
    client = KubeClient.from_settings(config.host.kubeconfig)
    kubelet = DraKubeletSimulator(config.host.plugins_registry_dir,
                                  get_claim=client.get_resource_claim, node_name=DRA_NODE)
    try:
        started = time.monotonic()
        await kubelet.start()
        await kubelet.wait_registered(driver)
        plugin = kubelet.plugin(driver)
        assert plugin is not None  # wait_registered returned
        print(f"\n{DRA_RESOURCE} through DRA: driver {driver} registered with the plugin "
              f"watcher in {(time.monotonic() - started) * 1000:.0f} ms "
              f"({plugin.chosen_service}, {plugin.endpoint})")
        await app.dra.publisher.wait_synced()
        for piece in api.resource_slices(driver, DRA_NODE):
            spec = piece["spec"]
            print(f"ResourceSlice {piece['metadata']['name']}: pool {spec['pool']['name']} "
                  f"generation {spec['pool']['generation']}, {len(spec['devices'])} devices")
            for device in spec["devices"]:
                attrs = {k.rsplit("/", 1)[-1]: next(iter(v.values()))
                         for k, v in (device.get("attributes") or {}).items()}
                shown = ", ".join(f"{k}={attrs[k]}" for k in sorted(attrs)[:5])
                print(f"  {device['name']}: {shown}")
        devices = api.devices(driver, DRA_NODE)
        if not devices:
            return
        first = sorted(devices)[0]
        # The pod the claim is reserved for, as the scheduler leaves it: its one container
        # uses the claim, so the prepare knows what that container receives.
        pod = api.put_pod({
            "metadata": {"name": "demo-pod", "namespace": "default"},
            "spec": {"resourceClaims": [{"name": "gpu", "resourceClaimName": "demo-gpu"}],
                     "containers": [{"name": "rocm", "image": "rocm/dev-ubuntu-24.04",
                                     "resources": {"claims": [{"name": "gpu"}]}}]}},
        )["metadata"]["uid"]
        api.put_resource_claim({
            "metadata": {"name": "demo-gpu", "namespace": "default"},
            "spec": {"devices": {"requests": [
                {"name": "gpu", "exactly": {"deviceClassName": "amd-gpu"}}]}},
            "status": {"allocation": {"devices": {"results": [
                {"request": "gpu", "driver": driver, "device": first,
                 "pool": naming.pool_name(DRA_RESOURCE, DRA_NODE)}]}},
                "reservedFor": [{"resource": "pods", "name": "demo-pod", "uid": pod}]}})
        [claim] = await kubelet.prepare(pod, [("default", "demo-gpu")])
        ids = claim.cdi_devices("gpu")
        print(f"NodePrepareResources for claim default/demo-gpu: {first} -> CDI {ids}")
        for path in sorted(os.listdir(config.host.cdi_dir)):
            if path.startswith("device-plugin-host-claim_"):
                with open(os.path.join(config.host.cdi_dir, path), encoding="utf-8") as spec:
                    body = json.load(spec)
                edits = [n["path"] for d in body["devices"]
                         for n in d["containerEdits"].get("deviceNodes", ())]
                print(f"  CDI spec {path}: kind {body['kind']}, device nodes {edits}")
        await kubelet.unprepare(pod)
        left = [p for p in os.listdir(config.host.cdi_dir)
                if p.startswith("device-plugin-host-claim_")]
        print(f"NodeUnprepareResources: claim spec removed ({len(left)} claim specs left)")
    finally:
        await kubelet.stop()
        await client.close()
