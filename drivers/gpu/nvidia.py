"""What the NVIDIA kernel driver says about each GPU it serves, from its procfs.

The GPU's device node is /dev/nvidiaN where N is the *minor number the driver assigned*, not the
GPU's position in PCI order or nvidia-smi's index: GPUs excluded with NVreg_ExcludedGpus, or
assigned with NVreg_AssignGpus, leave gaps and reorderings. The only place the kernel publishes
the pairing of PCI address and minor is /proc/driver/nvidia/gpus/<address>/information, written
by nv-procfs.c as ``"Key: \\t value"`` lines, e.g.::

    Model:           NVIDIA H100 80GB HBM3
    IRQ:             551
    GPU UUID:        GPU-5f3e27c5-0d43-1b8b-6c1f-8b1e6a6f0c11
    Video BIOS:      96.00.74.00.01
    Bus Type:        PCIe
    DMA Size:        52 bits
    DMA Mask:        0xfffffffffffff
    Bus Location:    0000:18:00.0
    Device Minor:    0
    GPU Firmware:    535.129.03
    GPU Excluded:    No

Drivers before R450 print ``Blacklisted:`` instead of ``GPU Excluded:``. A GPU the driver could
not initialise shows ``GPU-????????-????-????-????-????????????`` and ``??.??.??.??.??``: those
are "unknown", never identifiers.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Dict, Mapping, NamedTuple, Optional

from device_plugin_host import Device, HostFS

PROC_GPUS = "/proc/driver/nvidia/gpus"

#: Minors 254 and 255 are /dev/nvidia-modeset and /dev/nvidiactl; GPUs get the ones below.
MAX_GPU_MINOR = 253

#: The kernel mode-setting (display) interface of nvidia-modeset.ko, which compute does not
#: use: libnvidia-container binds it only for the "display" driver capability (nvc_mount.c:
#: "Only display capability requires the modeset device"; CUDA images ask for compute and
#: utility), and NVIDIA's device plugin leaves device nodes to that runtime by default. Its
#: passDeviceSpecs mode and nvidia-ctk's generated CDI spec (common-nvml.go) do add it
#: wherever it exists; ``nvidia_modeset = true`` on a resource does the same here, for
#: display and Vulkan workloads. Default off: least device access for compute pods.
MODESET_NODE = "/dev/nvidia-modeset"
MODESET_SETTING = "nvidia_modeset"


def apply_modeset_setting(device: Device, settings: Mapping[str, object]) -> Device:
    """The device as a resource with these settings hands it out: without /dev/nvidia-modeset
    unless ``nvidia_modeset = true``."""
    if settings.get(MODESET_SETTING) is True:
        return device
    nodes = tuple(n for n in device.device_nodes if n.host_path != MODESET_NODE)
    if len(nodes) == len(device.device_nodes):
        return device
    return replace(device, device_nodes=nodes)

_UUID = re.compile(
    r"GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\Z", re.IGNORECASE
)


class NvidiaInfo(NamedTuple):
    """The parsed information file; a field is None when absent, unknown or garbage."""

    path: str
    model: Optional[str]
    uuid: Optional[str]
    vbios: Optional[str]
    bus_location: Optional[str]
    minor: Optional[int]
    minor_text: Optional[str]  # what the file said, for a reason when it is garbage
    excluded: bool


def parse_information(text: str) -> Dict[str, str]:
    """The file's ``Key: value`` pairs. Only the first colon splits, so ``Bus Location:
    0000:18:00.0`` keeps its address whole; lines without a colon are ignored."""
    fields: Dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip():
            fields[key.strip()] = value.strip()
    return fields


def information_path(address: str) -> str:
    return f"{PROC_GPUS}/{address}/information"


def read_information(host: HostFS, address: str) -> Optional[NvidiaInfo]:
    """The driver's view of one GPU; None when it has no information file (driver not loaded,
    GPU bound elsewhere, or /proc of the host not visible under the root)."""
    path = information_path(address)
    text = host.read(path)
    if text is None:
        return None
    fields = parse_information(text)
    minor_text = fields.get("Device Minor")
    minor: Optional[int] = None
    if minor_text is not None and minor_text.isdigit():
        value = int(minor_text)
        if value <= MAX_GPU_MINOR:
            minor = value
    uuid = fields.get("GPU UUID")
    vbios = fields.get("Video BIOS")
    excluded = fields.get("GPU Excluded", fields.get("Blacklisted", "No"))
    return NvidiaInfo(
        path=path,
        model=fields.get("Model") or None,
        uuid=uuid if uuid and _UUID.match(uuid) else None,
        vbios=vbios if vbios and "?" not in vbios else None,
        bus_location=fields.get("Bus Location") or None,
        minor=minor,
        minor_text=minor_text,
        excluded=excluded.strip().lower().startswith("yes"),
    )


def proc_addresses(host: HostFS) -> list:
    """PCI addresses the driver has information files for (its view of "my GPUs")."""
    return host.listdir(PROC_GPUS)
