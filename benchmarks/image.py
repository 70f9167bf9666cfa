"""Start-up inside the image: ``podman run`` of the image built by deploy/container/build with
the DaemonSet's own options (deploy/container/daemonset_run.py reads them from the manifest)
to every resource registered with the kubelet simulator on this side of the mounts, against
the same host started on this machine (``python -m host run``) on the same fake tree and
config. The key's value is the container's median, its floor the host's median, so its ratio
is what the image costs at start-up (runtime set-up, mounts, an interpreter starting cold from
the image's own bytecode).

Skipped with the reason (neither figures nor missing) where podman or the image is absent.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType
from typing import List, Sequence

from benchmarks.core import REPO, Context, Figure, Skipped, child_env, median, now, short_dir
from benchmarks.startup import build_gpu_tree
from host.sim.kubelet import KubeletSimulator

KEYS = ("image_startup_ratio",)
IMAGE = os.environ.get("DPH_IMAGE", "localhost/device-plugin-host:0.1.0-amd64")
CONFIG = REPO / "deploy" / "kubernetes" / "base" / "config.toml"


def _daemonset_run() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "daemonset_run", REPO / "deploy" / "container" / "daemonset_run.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("daemonset_run", module)
    spec.loader.exec_module(module)
    return module


def _registered(kubelet: KubeletSimulator) -> bool:
    return bool(kubelet.resources) and all(
        r.connected and r.snapshots for r in kubelet.resources.values())


async def _start(command: Sequence[str], plugin_dir: str, stop: Sequence[str]) -> float:
    """Milliseconds from spawning ``command`` to its resources registered."""
    async with KubeletSimulator(plugin_dir) as kubelet:
        started = now()
        process = await asyncio.create_subprocess_exec(
            *command, cwd=str(REPO), env=child_env(), stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
        try:
            try:
                await kubelet.wait_for(_registered, timeout=60, what="the host registered")
            except TimeoutError:
                if process.returncode is None:
                    process.send_signal(signal.SIGTERM)
                assert process.stderr is not None
                errors = await asyncio.wait_for(process.stderr.read(), 30)
                raise RuntimeError(f"{command[0]} never registered: "
                                   f"{errors.decode(errors='replace')[-1500:]}") from None
            return (now() - started) * 1000
        finally:
            if stop:
                subprocess.run(list(stop), capture_output=True, timeout=60, check=False)
            if process.returncode is None:
                process.send_signal(signal.SIGTERM)
                try:
                    await asyncio.wait_for(process.wait(), 30)
                except asyncio.TimeoutError:
                    process.kill()
                    await process.wait()


async def _measure(ctx: Context) -> List[Figure]:
    podman = shutil.which("podman")
    if podman is None:
        raise Skipped("podman is not installed")
    if subprocess.run([podman, "image", "exists", IMAGE], check=False).returncode != 0:
        raise Skipped(f"no image {IMAGE}: run deploy/container/build")
    run = _daemonset_run()
    runs = ctx.pick(7, 3, 1)
    with tempfile.TemporaryDirectory(prefix="dphb-image-", dir="/tmp") as work, \
            short_dir() as short:
        root = Path(work) / "root"
        build_gpu_tree(str(root))
        run.prepare_host_root(root)
        config_dir = Path(work) / "config"
        config_dir.mkdir()
        shutil.copy(CONFIG, config_dir / "config.toml")
        pod, container = run.load()
        plan = run.plan(pod, container, run.host_dirs(root), str(config_dir))
        plugin_dir = str(root / "var/lib/kubelet/device-plugins")
        # The host on this machine: the same config but for the metrics port (the container's
        # :9400 is its own network namespace's; here any free loopback port).
        host_config = Path(work) / "host.toml"
        host_config.write_text(CONFIG.read_text().replace(
            'metrics_address = ":9400"', 'metrics_address = "127.0.0.1:0"'))
        # The same directory by a short name: the host refuses a plugin directory whose socket
        # paths would pass the unix socket path limit.
        host_plugin_dir = os.path.join(short, "d")
        os.symlink(plugin_dir, host_plugin_dir)
        host_cmd = [sys.executable, "-m", "host", "run", "--config", str(host_config),
                    "--plugin-dir", host_plugin_dir, "--host-root", str(root)]
        name = f"dphb-image-{os.getpid()}"
        image_cmd = [podman, "run", "--rm", "--name", name, *run.runtime_options(),
                     *plan.options, IMAGE, *plan.arguments]
        stop = [podman, "rm", "-f", "-t", "5", name]
        inside: List[float] = []
        outside: List[float] = []
        bare: List[float] = []  # podman run of /bin/true with the same options: the runtime's share
        true_cmd = [podman, "run", "--rm", *run.runtime_options(), *plan.options,
                    "--entrypoint", "/bin/true", IMAGE]
        if not ctx.tiny:  # warm-ups: the page cache, podman's storage
            await _start(image_cmd, plugin_dir, stop)
            await _start(host_cmd, host_plugin_dir, ())
        for _ in range(runs):
            ctx.progress("image start-up")
            inside.append(await _start(image_cmd, plugin_dir, stop))
            outside.append(await _start(host_cmd, host_plugin_dir, ()))
            started = now()
            subprocess.run(true_cmd, capture_output=True, timeout=60, check=True)
            bare.append((now() - started) * 1000)
    size = subprocess.run([podman, "image", "inspect", "-f", "{{.Size}}", IMAGE],
                          capture_output=True, text=True, check=False).stdout.strip()
    notes = [f"median of {runs}: podman run (runc) of {IMAGE} with the DaemonSet's options "
             f"{median(inside):.0f} ms (max {max(inside):.0f}), the same host on this machine "
             f"{median(outside):.0f} ms (max {max(outside):.0f}); podman run of /bin/true with "
             f"the same options {median(bare):.0f} ms; image {size} bytes"]
    return [Figure("image_startup_ratio", median(inside), "ms", median(outside), notes)]


def run(ctx: Context) -> List[Figure]:
    return asyncio.run(_measure(ctx))
