"""A DRA node that boots: the host started before the kubelet registered the Node waits for
it (serving its device plugin resources meanwhile) and publishes once it exists; a Node
deleted and registered again (a new uid) gets every slice owned by the new uid.

Each test runs against the stand-in and against the real kube-apiserver (KUBEBUILDER_ASSETS).
Neither runs kube-controller-manager, so no garbage collector removes a deleted Node's slices:
the host has to rewrite them itself; ``collect_garbage`` does what the collector would.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import pytest

from device_plugin_host_testing.drivers import MemoryDriver, make_devices
from device_plugin_host_testing.harness import make_config
from host.app import HostApp
from host.core.model import ResourceConfig
from host.dra import naming
from host.dra.kube import KubeClient
from host.sim import fake_gpu
from host.sim.apiserver import ApiServerStandIn, RealApiServer, kubebuilder_assets
from host.sim.kubelet import KubeletSimulator
from host.sim.kubelet_dra import DraKubeletSimulator
from host.sim.tree import FakeTree

REPO = Path(__file__).resolve().parents[2]
NODE = "boot-node"
DP_NAME = "nvidia.com/gpu"
DRA_NAME = "example.com/gpu"
NODE_DELAY_S = 10.0  # the kubelet registers the Node this long after the host started


@pytest.fixture(params=["standin", "real"])
def api_server(request):
    if request.param == "real":
        assets = kubebuilder_assets()
        if not assets:
            pytest.skip("KUBEBUILDER_ASSETS does not name a directory with kube-apiserver "
                        "and etcd")
        server: Any = RealApiServer(assets)
    else:
        server = ApiServerStandIn()
    with server:
        yield server


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _get(url: str) -> Tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def _owners(slices: List[Dict[str, Any]]) -> List[Optional[str]]:
    """The Node uid each slice names as owner (None: no Node owner)."""
    out = []
    for piece in slices:
        refs = [r for r in piece["metadata"].get("ownerReferences") or []
                if r.get("kind") == "Node"]
        out.append(refs[0]["uid"] if refs else None)
    return out


def _config_file(tmp_path: Path, short_dir: str, api: Any, metrics_port: int) -> Path:
    root = tmp_path / "root"
    tree = FakeTree(root)
    tree.numa_nodes(1)
    fake_gpu.add_nvidia_control_nodes(tree)
    fake_gpu.add_nvidia_gpu(tree, "0000:18:00.0", minor=0, numa_node=0)
    fake_gpu.add_nvidia_gpu(tree, "0000:86:00.0", minor=1, numa_node=0)
    config = tmp_path / "config.toml"
    config.write_text(
        "[host]\n"
        f'plugin_dir = "{short_dir}/dp"\n'
        f'host_root = "{root}"\n'
        f'drain_file = "{tmp_path}/drain/drained"\n'
        f'cdi_dir = "{tmp_path}/cdi"\n'
        f'metrics_address = "127.0.0.1:{metrics_port}"\n'
        'nfd_features_file = ""\n'
        f'node_name = "{NODE}"\n'
        f'kubeconfig = "{api.kubeconfig_path}"\n'
        f'plugins_registry_dir = "{short_dir}/registry"\n'
        f'dra_plugins_dir = "{short_dir}/plugins"\n'
        f'dra_state_dir = "{tmp_path}/dra-state"\n'
        "[[resource]]\n"
        f'name = "{DP_NAME}"\ndriver = "gpu"\n'
        '[resource.selectors]\npci_address = ["0000:18:00.0"]\n'
        "[[resource]]\n"
        f'name = "{DRA_NAME}"\ndriver = "gpu"\napi = "dra"\n'
        '[resource.selectors]\npci_address = ["0000:86:00.0"]\n')
    return config


def test_a_host_started_before_its_node_waits_and_publishes_within_1s_of_it(
        api_server, short_dir, tmp_path):
    """`device-plugin-host run --config ...` (the systemd unit's command line) before the
    Node exists: it never exits, its device plugin resource registers at once, /healthz
    and the metric say it waits, and the pool is published within 1 s of the Node's
    creation 10 s later, owned by that Node."""
    api = api_server
    port = _free_port()
    config = _config_file(tmp_path, short_dir, api, port)
    os.makedirs(f"{short_dir}/dp")
    dra_driver = naming.driver_name(DRA_NAME, None)
    log_path = tmp_path / "host.log"

    async def scenario() -> None:
        sim = KubeletSimulator(f"{short_dir}/dp")
        await sim.start()
        client = KubeClient.from_settings(api.kubeconfig_path)
        dra_sim = DraKubeletSimulator(f"{short_dir}/registry", node_name=NODE,
                                      get_claim=client.get_resource_claim)
        await dra_sim.start()
        env = {k: v for k, v in os.environ.items() if k != "NODE_NAME"}
        env["PYTHONPATH"] = str(REPO)
        with open(log_path, "wb") as log_file:
            started = time.monotonic()
            process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "host", "run", "--config", str(config),
                env=env, cwd=str(REPO), stdout=log_file, stderr=asyncio.subprocess.STDOUT)
        loop = asyncio.get_running_loop()
        try:
            await sim.wait_for(lambda s: DP_NAME in s.resources
                               and s.resources[DP_NAME].connected
                               and s.resources[DP_NAME].snapshots, timeout=30,
                               what="the device plugin resource registered")
            assert process.returncode is None
            # /healthz says it waits (and stays 200: a restart would not help); the metric 0
            deadline = time.monotonic() + 10
            while True:
                status, body = await loop.run_in_executor(
                    None, _get, f"http://127.0.0.1:{port}/healthz")
                if "waiting for Node" in body or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.1)
            assert status == 200 and body.startswith("ok\n"), body
            assert f"waiting for Node '{NODE}'" in body, body
            _, metrics = await loop.run_in_executor(
                None, _get, f"http://127.0.0.1:{port}/metrics")
            assert "device_plugin_host_dra_node_registered 0" in metrics
            assert api.resource_slices(dra_driver, NODE) == []
            # The kubelet registers the Node 10 s after the host started.
            await asyncio.sleep(max(0.0, started + NODE_DELAY_S - time.monotonic()))
            assert process.returncode is None, log_path.read_text()
            assert api.resource_slices(dra_driver, NODE) == []  # nothing without a Node
            created = time.monotonic()
            node = api.add_node(NODE)
            uid = node["metadata"]["uid"]

            def published(a: Any) -> bool:
                slices = a.resource_slices(dra_driver, NODE)
                return bool(slices) and set(_owners(slices)) == {uid}

            ok = await loop.run_in_executor(None, lambda: api.wait_for(published, 5))
            took = time.monotonic() - created
            assert ok, log_path.read_text()
            print(f"pool published {took * 1000:.0f} ms after the Node's creation")
            assert took < 1.0, f"published {took:.2f} s after the Node's creation"
            assert sorted(api.devices(dra_driver, NODE)) == [
                naming.dra_device_name("0000:86:00.0")]
            status, body = await loop.run_in_executor(
                None, _get, f"http://127.0.0.1:{port}/healthz")
            assert (status, body) == (200, "ok\n")
            _, metrics = await loop.run_in_executor(
                None, _get, f"http://127.0.0.1:{port}/metrics")
            assert "device_plugin_host_dra_node_registered 1" in metrics
            assert process.returncode is None
            process.send_signal(signal.SIGTERM)
            await asyncio.wait_for(process.wait(), 20)
            assert process.returncode == 0, log_path.read_text()
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
            await sim.stop()
            await dra_sim.stop()
            await client.close()

    asyncio.run(scenario())
    output = log_path.read_text()
    assert "Traceback" not in output, output
    waits = [line for line in output.splitlines() if "does not exist (yet)" in line]
    assert len(waits) == 1, output  # said once, then at debug
    assert "registered (uid" in output, output


def test_a_node_name_that_is_no_node_name_is_still_exit_2_and_check_config_says_so(
        short_dir, tmp_path):
    config = tmp_path / "config.toml"
    config.write_text(
        f'[host]\nplugins_registry_dir = "{short_dir}/r"\ndra_plugins_dir = "{short_dir}/p"\n'
        f'metrics_address = ""\ndrain_file = "{short_dir}/d/drained"\n'
        '[[resource]]\nname = "example.com/gpu"\ndriver = "gpu"\napi = "dra"\n')
    (tmp_path / "sys").mkdir()
    import subprocess

    env = dict(os.environ, NODE_NAME="Worker_7")
    result = subprocess.run(
        [sys.executable, "-m", "host", "run", "--config", str(config), "--plugin-dir",
         short_dir, "--host-root", str(tmp_path)],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=60)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if "cannot serve DRA" in line]
    assert len(lines) == 1 and "'Worker_7'" in lines[0] and "not a valid Node name" in lines[0]
    assert "Traceback" not in result.stderr
    # check-config says which case is which: this one exits 2, a valid name is waited for
    checked = subprocess.run(
        [sys.executable, "-m", "host", "check-config", str(config), "--host-root",
         str(tmp_path)], capture_output=True, text=True, env=env, cwd=REPO, timeout=60)
    assert checked.returncode == 2, checked.stdout + checked.stderr
    assert "'Worker_7'" in checked.stderr and "not a valid Node name" in checked.stderr
    env["NODE_NAME"] = "worker-7"
    checked = subprocess.run(
        [sys.executable, "-m", "host", "check-config", str(config), "--host-root",
         str(tmp_path)], capture_output=True, text=True, env=env, cwd=REPO, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "DRA: node worker-7: if its Node is not registered yet, `run` waits for it" in \
        checked.stdout


GPU = ResourceConfig(name="example.com/gpu", driver="memory", api="dra")
FPGA = ResourceConfig(name="example.com/fpga", driver="memory", api="dra")


def test_a_node_registered_again_gets_every_slice_owned_by_the_new_uid(api_server, short_dir,
                                                                       run):
    """`kubectl delete node` and the kubelet's new registration: within 2 s every slice of
    ours names the new uid and none the old one; nothing is written while there is no Node
    (slices written then would name no owner, or a dead one); and where a garbage collector
    removed the old slices they come back owned by the new Node."""
    api = api_server
    old = api.add_node(NODE)
    config = make_config(os.path.join(short_dir, "dp"), [GPU, FPGA], node_name=NODE,
                         kubeconfig=api.kubeconfig_path,
                         plugins_registry_dir=os.path.join(short_dir, "registry"),
                         dra_plugins_dir=os.path.join(short_dir, "plugins"),
                         dra_state_dir=os.path.join(short_dir, "state"),
                         cdi_dir=os.path.join(short_dir, "cdi"),
                         drain_file=os.path.join(short_dir, "drain", "drained"),
                         rescan_interval_s=0)
    # 130 devices: the GPU pool needs two slices (128 devices per slice at most).
    driver = MemoryDriver(devices={GPU.name: make_devices("gpu", 130),
                                   FPGA.name: make_devices("fpga", 2)})
    drivers = [naming.driver_name(r.name, None) for r in (GPU, FPGA)]

    def ours(a: Any) -> List[Dict[str, Any]]:
        return [s for d in drivers for s in a.resource_slices(d, NODE)]

    async def replaced(app: HostApp, collect: bool) -> Tuple[float, str]:
        loop = asyncio.get_running_loop()
        before = ours(api)
        api.delete_node(NODE)
        deadline = loop.time() + 5
        while not app.dra.node_watch.waiting() and loop.time() < deadline:
            await asyncio.sleep(0.01)  # the host sees the deletion ...
        if collect:
            # (the collector acts on the deletion later than a watch hears of it; slices
            # collected before the host heard would be written once more with the old uid,
            # collected again, and rewritten with the new uid once the Node is back)
            assert api.collect_garbage() == len(before)
        await asyncio.sleep(0.5)
        # ... and writes nothing without a Node: the old slices stay as they were (no
        # garbage collector) or stay gone (one ran)
        if collect:
            assert ours(api) == []
        else:
            assert sorted(s["metadata"]["resourceVersion"] for s in ours(api)) == \
                sorted(s["metadata"]["resourceVersion"] for s in before)
        assert "waiting for Node" in "".join(app.dra.node_watch.waiting())
        created = time.monotonic()
        new_uid = api.add_node(NODE)["metadata"]["uid"]

        def owned(a: Any) -> bool:
            slices = ours(a)
            return len(slices) == 3 and set(_owners(slices)) == {new_uid}

        ok = await loop.run_in_executor(None, lambda: api.wait_for(owned, 5))
        took = time.monotonic() - created
        print(f"every slice owned by the new uid {took * 1000:.0f} ms after the Node's "
              f"creation (garbage collected before: {collect})")
        assert ok, [(s["metadata"]["name"], _owners([s])) for s in ours(api)]
        return took, new_uid

    async def body() -> None:
        client = KubeClient.from_settings(api.kubeconfig_path)
        dra_kubelet = DraKubeletSimulator(config.host.plugins_registry_dir, node_name=NODE,
                                          get_claim=client.get_resource_claim)
        await dra_kubelet.start()
        app = HostApp(config, {"memory": driver}, events=None)
        await app.start()
        try:
            await dra_kubelet.wait_registered(*drivers)
            assert await app.dra.publisher.wait_synced()
            first = ours(api)
            assert len(first) == 3 and set(_owners(first)) == {old["metadata"]["uid"]}
            took, uid = await replaced(app, collect=False)
            assert took < 2.0, f"owned by the new Node {took:.2f} s after it was created"
            assert app.dra.node_watch.waiting() == []
            took, uid2 = await replaced(app, collect=True)
            assert took < 2.0, f"owned by the new Node {took:.2f} s after it was created"
            assert uid2 != uid
            assert sorted(api.devices(drivers[0], NODE)) == sorted(f"gpu{i}" for i in range(130))
        finally:
            await app.stop()
            await dra_kubelet.stop()
            await client.close()

    run(body(), timeout=60)


def test_the_node_watch_follows_deletion_and_refused_rbac(run, caplog):
    """A Node deleted and registered again is seen as None then the new uid; where list and
    watch on nodes are refused (an older RBAC with get only) the Node is read with get every
    POLL_S instead, said once."""
    from host.dra.kube import KubeClient
    from host.dra.node import POLL_S, NodeWatch

    with ApiServerStandIn() as api:
        async def until(predicate: Any, timeout: float = 5.0) -> None:
            deadline = asyncio.get_running_loop().time() + timeout
            while not predicate():
                assert asyncio.get_running_loop().time() < deadline
                await asyncio.sleep(0.01)

        async def body() -> None:
            client = KubeClient.from_settings(api.kubeconfig_path)
            seen: List[Optional[str]] = []
            watch = NodeWatch(client, NODE, seen.append)
            watch.start()
            try:
                await until(lambda: seen == [None])  # listed: no Node, said at once
                assert watch.waiting()
                first = api.add_node(NODE)["metadata"]["uid"]
                await until(lambda: seen == [None, first])
                assert watch.waiting() == []
                api.delete_node(NODE)
                second = api.add_node(NODE)["metadata"]["uid"]
                await until(lambda: seen == [None, first, None, second])
                # refused list/watch: the watch is cut (the server restarts), then polled
                api.fail_next(403, count=10_000, verbs={"list", "watch"})
                api.stop()
                api.start()
                api.delete_node(NODE)
                await until(lambda: seen[-1] is None, timeout=3 * POLL_S + 5)
                third = api.add_node(NODE)["metadata"]["uid"]
                await until(lambda: seen[-1] == third, timeout=3 * POLL_S + 5)
            finally:
                await watch.close()
                await client.close()

        run(body(), timeout=60)
    refused = [r for r in caplog.records if "cannot list/watch Node" in r.getMessage()]
    assert len(refused) == 1
