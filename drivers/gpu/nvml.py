"""What only NVML knows: MIG mode, MIG profile names and UUIDs, NVLink peers.

NVML comes from the optional extra ``nvidia-ml-py`` (``pip install
'device-plugin-host[nvidia]'``, module ``pynvml``) and is imported only when a scan needs it,
so a node without NVIDIA GPUs, or without the library, never loads libnvidia-ml. Every NVML
failure (library missing, libnvidia-ml.so missing, driver/library mismatch, a call that
raises) ends in an ``NvmlView`` that says why it is unavailable: the procfs view of MIG still
serves, and nothing here can fail a scan.

The view is keyed by PCI address, normalised to sysfs's ``0000:18:00.0`` (NVML prints an
8-digit domain, ``00000000:18:00.0``), so it joins what the driver read from sysfs and
procfs; entries for addresses the tree does not have are simply never looked up.
"""

from __future__ import annotations

import logging
import re
from types import MappingProxyType
from typing import Any, Dict, Mapping, NamedTuple, Optional, Protocol, Set, Tuple

logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'device-plugin-host[nvidia]'"
_MIG_NAME = re.compile(r"\bMIG\s+(\S+)\s*\Z")


class NvmlMig(NamedTuple):
    uuid: Optional[str]  # "MIG-5f2b..."
    profile: Optional[str]  # "1g.10gb"; None when NVML's name does not say it


class NvmlView(NamedTuple):
    available: bool
    reason: str = ""  # why not available
    mig_mode: Mapping[str, bool] = MappingProxyType({})  # address -> current MIG mode
    migs: Mapping[Tuple[str, int, int], NvmlMig] = MappingProxyType({})  # (addr, gi, ci)
    nvlink_peers: Mapping[str, Set[str]] = MappingProxyType({})


class NvmlSource(Protocol):
    """Where the driver gets NVML's view; tests pass their own."""

    def read(self) -> NvmlView: ...


def normalise_bus_id(bus_id: Any) -> str:
    text = bus_id.decode() if isinstance(bus_id, bytes) else str(bus_id)
    text = text.strip().lower()
    domain, sep, rest = text.partition(":")
    if not sep:
        return text
    return f"{int(domain, 16):04x}:{rest}"


def profile_from_name(name: str) -> Optional[str]:
    """NVML names a MIG device "NVIDIA A100-SXM4-40GB MIG 1g.5gb": the profile is the last
    word after "MIG". Anything else is no profile (never guessed)."""
    match = _MIG_NAME.search(name)
    return match.group(1) if match else None


class PynvmlSource:
    """The real NVML, through nvidia-ml-py."""

    def read(self) -> NvmlView:
        try:
            import pynvml
        except ImportError:
            return NvmlView(False, f"nvidia-ml-py is not installed ({INSTALL_HINT})")
        try:
            pynvml.nvmlInit()
        except Exception as error:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
            return NvmlView(False, f"NVML did not initialise: {error}")
        try:
            return _read(pynvml)
        except Exception as error:
            logger.warning("gpu: NVML failed while reading: %s", error)
            return NvmlView(False, f"NVML failed: {type(error).__name__}: {error}")
        finally:
            try:
                pynvml.nvmlShutdown()
            except Exception as error:  # pragma: no cover - nothing to do about it
                logger.debug("gpu: nvmlShutdown: %s", error)


def _read(nv: Any) -> NvmlView:
    mig_mode: Dict[str, bool] = {}
    migs: Dict[Tuple[str, int, int], NvmlMig] = {}
    peers: Dict[str, Set[str]] = {}
    for index in range(nv.nvmlDeviceGetCount()):
        handle = nv.nvmlDeviceGetHandleByIndex(index)
        address = normalise_bus_id(nv.nvmlDeviceGetPciInfo(handle).busId)
        try:
            current, _pending = nv.nvmlDeviceGetMigMode(handle)
        except nv.NVMLError:  # NOT_SUPPORTED on GPUs without MIG
            current = 0
        enabled = current == getattr(nv, "NVML_DEVICE_MIG_ENABLE", 1)
        mig_mode[address] = enabled
        if enabled:
            for slot in range(nv.nvmlDeviceGetMaxMigDeviceCount(handle)):
                try:
                    mig = nv.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
                except nv.NVMLError:  # NOT_FOUND: an empty slot
                    continue
                gi = nv.nvmlDeviceGetGpuInstanceId(mig)
                ci = nv.nvmlDeviceGetComputeInstanceId(mig)
                name = nv.nvmlDeviceGetName(mig)
                name = name.decode() if isinstance(name, bytes) else str(name)
                uuid = nv.nvmlDeviceGetUUID(mig)
                uuid = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
                migs[(address, int(gi), int(ci))] = NvmlMig(uuid or None, profile_from_name(name))
        for link in range(getattr(nv, "NVML_NVLINK_MAX_LINKS", 18)):
            try:
                if nv.nvmlDeviceGetNvLinkState(handle, link) != nv.NVML_FEATURE_ENABLED:
                    continue
                remote = nv.nvmlDeviceGetNvLinkRemotePciInfo(handle, link)
            except nv.NVMLError:  # NOT_SUPPORTED, INVALID_ARGUMENT past the last link
                continue
            peers.setdefault(address, set()).add(normalise_bus_id(remote.busId))
    return NvmlView(True, "", mig_mode, migs, _gpu_peers(peers, set(mig_mode)))


def _gpu_peers(links: Dict[str, Set[str]], gpus: Set[str]) -> Dict[str, Set[str]]:
    """GPU -> GPUs it reaches over NVLink. On HGX boards the links end at NVSwitches, not
    GPUs: GPUs that share a switch reach each other in one hop, so they are peers too."""
    out: Dict[str, Set[str]] = {}
    switches: Dict[str, Set[str]] = {}
    for gpu, remotes in links.items():
        for remote in remotes:
            if remote in gpus:
                out.setdefault(gpu, set()).add(remote)
            else:
                switches.setdefault(remote, set()).add(gpu)
    for members in switches.values():
        for gpu in members:
            out.setdefault(gpu, set()).update(members - {gpu})
    return out
