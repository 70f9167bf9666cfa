"""Device-information files for Multus and the SR-IOV CNI (the NPWG Device Information spec).

The contract (k8snetworkplumbingwg/device-info-spec SPEC.md 4.1, and the file helpers of
network-attachment-definition-client that Multus and sriov-network-device-plugin share): one
JSON file per allocated device at ``/var/run/k8s.cni.cncf.io/devinfo/dp/<resource>-<device
id>-device.json`` with every "/" in both parts replaced by "-", holding
``{"type": "pci", "version": "1.1.0", "pci": {"pci-address": ..., "pf-pci-address": ...}}``.
The device plugin creates the directory when missing, writes the file read-only (0444, as the
client library does), and deletes its files when it stops. Multus copies the file for the CNI
at CNI ADD, which the kubelet runs after Allocate, so the file is written inside Allocate.

Removal. The kubelet never tells a plugin that a pod released a device, so the host reconciles:
every ``interval_s`` it lists the files of each resource that writes them and asks the
kubelet's PodResources API (which the host already reads for ``pods`` and metrics) which
devices are held. A file goes when its device is no longer served, or when no container holds
its device and it is older than ``grace_s`` (Allocate answers before the kubelet records the
allocation, so a fresh file is never judged by a List that may predate it). When the
PodResources API cannot be reached nothing is removed for being unheld: a file too many is
harmless, a file missing breaks a pod's network attachment. On stop every file goes; a host
that starts again while pods hold devices writes their files back at its first pass (a pod
sandbox re-created later finds its file again), so a file exists whenever a container holds
its device.

Files are written atomically (a temporary file with a random name, created without following
symlinks, in the same directory, then a rename): Multus never reads half a file.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from typing import (
    Awaitable,
    Callable,
    Dict,
    Iterable,
    List,
    Mapping,
    Optional,
    Sequence,
    Set,
    Tuple,
)

from host.core import fileio
from host.core.model import Device, ResourceConfig
from host.core.tasks import Background, cancel_and_wait
from host.outputs import Output

log = logging.getLogger(__name__)

DEFAULT_DIR = "/var/run/k8s.cni.cncf.io/devinfo/dp"
SPEC_VERSION = "1.1.0"
SUFFIX = "-device.json"
DEFAULT_INTERVAL_S = 60.0
DEFAULT_GRACE_S = 60.0


def enabled(resource: ResourceConfig) -> bool:
    return resource.settings.get("device_info") is True


def directory_of(resource: ResourceConfig) -> str:
    return str(resource.settings.get("device_info_dir") or DEFAULT_DIR)


def file_name(resource: str, device_id: str) -> str:
    """The spec's name: ``intel.com/sriov`` + ``0000:3b:01.2`` ->
    ``intel.com-sriov-0000:3b:01.2-device.json``."""
    return f"{resource.replace('/', '-')}-{device_id.replace('/', '-')}{SUFFIX}"


def pci_info(address: str, pf_address: Optional[str] = None,
             rdma_device: Optional[str] = None) -> Dict[str, object]:
    """A "pci" device-info map; optional keys only where known (spec 3.1.3)."""
    pci: Dict[str, str] = {"pci-address": address}
    if pf_address:
        pci["pf-pci-address"] = pf_address
    if rdma_device:
        pci["rdma-device"] = rdma_device
    return {"type": "pci", "version": SPEC_VERSION, "pci": pci}


def info_from_device(device: Device) -> Dict[str, object]:
    """The "pci" map of a served device, from the attributes PCI drivers set (``pci_address``,
    ``pf_pci_address``, a single ``rdma_device``); the id when there is no address."""
    attributes = device.attributes
    rdma = attributes.get("rdma_device", "")
    return pci_info(attributes.get("pci_address", device.id), attributes.get("pf_pci_address"),
                    rdma if rdma and "," not in rdma else None)


def write(directory: str, resource: str, device_id: str, info: Mapping[str, object]) -> str:
    """Write one file atomically; returns its path. Raises OSError with the path named."""
    os.makedirs(directory, mode=0o755, exist_ok=True)
    fileio.warn_if_shared(directory, "the device-info directory")
    path = os.path.join(directory, file_name(resource, device_id))
    data = json.dumps(info, separators=(",", ":")).encode()
    fileio.write_atomic(path, data, mode=0o444, prefix=".devinfo-")
    return path


def write_all(resource: ResourceConfig, devices: Sequence[Device]) -> None:
    """With ``device_info = true``, the NPWG device-info file of each device, written before
    the kubelet can start the pod's CNI. Raises RuntimeError naming the device and directory
    of a file that cannot be written (a pod whose attachment would miss it must not start)."""
    if not enabled(resource):
        return
    directory = directory_of(resource)
    for device in devices:
        try:
            write(directory, resource.name, device.id, info_from_device(device))
        except OSError as error:
            raise RuntimeError(
                f"cannot write the device-info file of {device.id} in {directory}: "
                f"{error.strerror or error}") from None


def owned(directory: str, resource: str) -> Dict[str, float]:
    """Device id -> modification time of this resource's files in ``directory``.

    Names are ``<resource>-<id>-device.json`` with "/" turned into "-", so a resource named
    ``a/b`` cannot tell its files from those of ``a/b-c`` by prefix alone: an id that still
    holds a "-" after the prefix is left alone (PCI addresses and replica ids never do)."""
    prefix = resource.replace("/", "-") + "-"
    out: Dict[str, float] = {}
    try:
        names = os.listdir(directory)
    except OSError:
        return out
    for name in names:
        if not (name.startswith(prefix) and name.endswith(SUFFIX)):
            continue
        device_id = name[len(prefix):-len(SUFFIX)]
        if not device_id or "-" in device_id:
            continue
        try:
            out[device_id] = os.stat(os.path.join(directory, name)).st_mtime
        except OSError:
            continue
    return out


def remove(directory: str, resource: str, device_id: str) -> bool:
    try:
        os.unlink(os.path.join(directory, file_name(resource, device_id)))
    except FileNotFoundError:
        return False
    except OSError as error:
        log.warning("resource %s: cannot remove device-info file of %s: %s", resource, device_id,
                    error)
        return False
    return True


#: (resource, device id) pairs some container holds, or None when the kubelet cannot say.
Held = Optional[Set[Tuple[str, str]]]


def stale(files: Mapping[str, float], served: Set[str], held: Held, resource: str,
          now: float, grace_s: float) -> List[str]:
    """Which of a resource's files to remove (pure, for the reconciler and its tests)."""
    out = []
    for device_id, mtime in sorted(files.items()):
        gone = device_id not in served
        unheld = held is not None and (resource, device_id) not in held
        if gone or (unheld and now - mtime >= grace_s):
            out.append(device_id)
    return out


def _rewritten(directory: str, resource: str, device_id: str, mtime: float) -> bool:
    try:
        return os.stat(os.path.join(directory, file_name(resource, device_id))).st_mtime != mtime
    except OSError:
        return False


class DeviceInfoReconciler(Output):
    """Owns the removal side, as an output: one background task, running while some
    resource writes device-info files; a resource that leaves the config or stops writing
    them has its files removed, and so has every resource on a stop that is no hand-over."""

    def __init__(
        self,
        resources: Callable[[], Sequence[ResourceConfig]],
        devices: Callable[[str], Iterable[Device]],
        held: Callable[[], Awaitable[Held]],
        *,
        interval_s: float = DEFAULT_INTERVAL_S,
        grace_s: float = DEFAULT_GRACE_S,
        background: Optional[Background] = None,
    ) -> None:
        # The reconciler's task belongs to the host's owner of background work.
        self._background = background if background is not None else Background("device-info")
        self._resources = resources
        self._devices = devices
        self._held = held
        self.interval_s = interval_s
        self.grace_s = grace_s
        self.first_pass_s = 2.0  # soon after start: restore the files of held devices
        self._task: Optional[asyncio.Task] = None
        self._kubelet_unknown_logged = False

    def _wanted(self) -> List[ResourceConfig]:
        return [r for r in self._resources() if enabled(r)]

    def start(self) -> None:
        if self._task is None and self._wanted():
            self._task = self._background.spawn(self._run(), "device-info reconcile")

    async def _run(self) -> None:
        delay = min(self.first_pass_s, self.interval_s)
        while True:
            await asyncio.sleep(delay)
            delay = self.interval_s
            try:
                await self.reconcile()
            except asyncio.CancelledError:
                raise
            except Exception:  # the reconciler must outlive any one bad pass
                log.exception("device-info reconcile failed")

    async def reconcile(self) -> List[str]:
        """One pass; returns the paths removed."""
        wanted = self._wanted()
        if not wanted:
            return []
        held = await self._held()
        # Listed after the kubelet answered: a file Allocate wrote since is younger than the
        # grace, so the answer that predates it cannot condemn it.
        listing = {r.name: owned(directory_of(r), r.name) for r in wanted}
        if held is None and not self._kubelet_unknown_logged:
            log.warning("device-info files: the kubelet's PodResources API is unavailable; "
                        "files of released devices stay until it answers")
            self._kubelet_unknown_logged = True
        elif held is not None:
            self._kubelet_unknown_logged = False
        removed = []
        now = time.time()
        for resource in wanted:
            devices = {d.id: d for d in self._devices(resource.name)}
            served = set(devices)
            directory = directory_of(resource)
            for holder, held_id in sorted(held or ()):
                if holder != resource.name or held_id in listing[resource.name]:
                    continue
                device = devices.get(held_id)
                if device is None:
                    continue
                try:
                    write(directory, resource.name, device.id, info_from_device(device))
                except OSError as error:
                    log.warning("resource %s: cannot restore the device-info file of %s: %s",
                                resource.name, device.id, error)
                    continue
                log.info("resource %s: device-info file of %s restored (a container holds it)",
                         resource.name, device.id)
            for device_id in stale(listing[resource.name], served, held, resource.name, now,
                                   self.grace_s):
                if _rewritten(directory, resource.name, device_id,
                              listing[resource.name][device_id]):
                    continue  # an Allocate wrote it again meanwhile (off the loop)
                if remove(directory, resource.name, device_id):
                    log.info("resource %s: device-info file of %s removed (%s)", resource.name,
                             device_id, "no longer served" if device_id not in served
                             else "no container holds it")
                    removed.append(os.path.join(directory, file_name(resource.name,
                                                                     device_id)))
        return removed

    def remove_resource(self, resource: ResourceConfig) -> None:
        """Every file of a resource: it stopped serving, or stopped writing files."""
        directory = directory_of(resource)
        for device_id in owned(directory, resource.name):
            remove(directory, resource.name, device_id)

    def synced(self, first: bool) -> None:
        self.start()

    def changed(self, before: ResourceConfig, after: ResourceConfig) -> None:
        if enabled(before) and not enabled(after):
            self.remove_resource(before)

    async def forget(self, resource: ResourceConfig) -> None:
        if enabled(resource):
            self.remove_resource(resource)

    async def close(self, hand_over: bool) -> None:
        await self.stop(remove=not hand_over)

    async def stop(self, remove: bool = True) -> None:
        """``remove``: False when another host serves the node now and keeps the files."""
        task, self._task = self._task, None
        await cancel_and_wait(task)
        if not remove:
            return
        for resource in self._wanted():
            self.remove_resource(resource)
