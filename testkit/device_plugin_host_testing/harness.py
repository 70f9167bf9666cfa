"""Run the real host in-process against a plugin dir and a kubelet simulator, for tests and
benchmarks: configs that keep to temporary paths, and the host beside its kubelet."""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import tempfile
import zlib
from typing import TYPE_CHECKING, Any, AsyncIterator, Dict, Optional, Sequence, Tuple, Union

from host.app import HostApp
from host.config import Config, HostSettings
from host.core.driver import Driver
from host.core.model import ResourceConfig
from host.sim.running import running_host
from host.triggers.uevents import EventSource

__all__ = ["kubelet_and_host", "make_config", "running_host"]

if TYPE_CHECKING:  # loaded by kubelet_and_host: a process running only the host needs none
    from host.sim.kubelet import KubeletSimulator

_drain_root: Optional[str] = None


def _drains() -> str:
    """One temp directory per process for every test config's drain marks, removed when the
    process exits: a directory per plugin dir in the system temp dir outlived each test (a
    suite run left ~140 empty ``dph-drain-*`` behind), and the host creates its drain file's
    directory on start, so no single test could own it."""
    global _drain_root
    if _drain_root is None:
        _drain_root = tempfile.mkdtemp(prefix="dph-drains-")
        atexit.register(shutil.rmtree, _drain_root, ignore_errors=True)
    return _drain_root


def make_config(plugin_dir: str, resources: Sequence[ResourceConfig], **host: object) -> Config:
    """A config for tests: the drain file defaults to a per-plugin-dir temp path (never the
    real /var/lib, never inside the plugin dir; the same plugin dir gets the same path, so a
    restarted host finds its marks); no NFD file and no PodResources socket unless given (a
    kubelet running on the machine must not answer a test's host)."""
    # CRC-32, like the host's socket names: hashlib would load OpenSSL's digests into the
    # benchmarks' host process (benchmarks/hostproc.py), which the real host never loads.
    digest = f"{zlib.crc32(plugin_dir.encode()):08x}"
    host.setdefault("drain_file", os.path.join(_drains(), digest, "drained"))
    host.setdefault("nfd_features_file", "")  # never the node's real NFD directory
    host.setdefault("pod_resources_socket", "")  # nor a kubelet running on this machine
    settings = HostSettings(plugin_dir=plugin_dir, **host)  # type: ignore[arg-type]
    return Config(path=None, host=settings, resources=tuple(resources), is_default=False)


@contextlib.asynccontextmanager
async def kubelet_and_host(
    config: Config,
    drivers: Dict[str, Driver],
    events: Union[str, EventSource, None] = None,
    **simulator: Any,
) -> AsyncIterator[Tuple[KubeletSimulator, HostApp]]:
    """A kubelet simulator on the config's plugin dir and the real host against it, with every
    served resource registered and its first snapshot received before the body runs."""
    from host.sim.kubelet import KubeletSimulator

    sim = KubeletSimulator(config.host.plugin_dir, **simulator)
    await sim.start()
    try:
        async with running_host(config, drivers, events=events) as app:
            served = app.served()
            await sim.wait_for(
                lambda k: all(n in k.resources and k.resources[n].connected
                              and k.resources[n].snapshots for n in served),
                what=f"{len(served)} resources registered",
            )
            yield sim, app
    finally:
        await sim.stop()
