"""``device-plugin-host capture``: a real machine's device tree as ``.tree`` text.

Part of the program, not of the test kit: operators run it on a node for a bug report, and
the test kit's ``FakeTree.load`` reads what it writes. Which sysfs trees
are walked is fixed below; which ``/dev`` nodes are recorded is each driver's own answer, its
``device_globs``, so a third-party driver's nodes are captured as soon as it is installed.

The format, one entry a line: ``d PATH`` a directory, ``f PATH "json string"`` an attribute
file, ``l PATH -> TARGET`` a link, ``c PATH MAJOR:MINOR`` a device node.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import posixpath
from typing import Iterable, Iterator, List, Sequence

log = logging.getLogger(__name__)

_CAPTURE_ROOTS = (
    "/sys/bus/pci/devices",
    "/sys/bus/usb/devices",
    "/sys/bus/dfl/devices",
    "/sys/bus/pci/drivers",  # each driver's ``module`` link: selectors name either
    "/sys/class/infiniband",
    "/sys/class/infiniband_verbs",
    "/sys/class/infiniband_mad",
    "/sys/class/misc/rdma_cm",
    "/sys/class/net",
    "/sys/class/drm",
    "/sys/class/fpga_region",
    "/sys/class/tty",
    "/sys/class/hidraw",
    "/sys/class/video4linux",
    "/sys/kernel/iommu_groups",
    "/sys/class/accel",
    "/sys/class/neuron_device",
    "/sys/dev/char",
    "/sys/class/kfd",  # AMD KFD topology: compute partitions and XGMI links
    "/proc/driver/nvidia/capabilities",  # MIG instances
    "/proc/driver/nvidia-caps",  # mig-minors
)
_CAPTURE_ATTRS = frozenset(
    "vendor device class numa_node local_cpulist enable subsystem_vendor subsystem_device "
    "sriov_numvfs sriov_totalvfs idVendor idProduct serial busnum devnum bInterfaceClass "
    "bInterfaceSubClass bInterfaceProtocol bDeviceClass manufacturer product dev uevent "
    "operstate carrier state phys_state link_layer node_guid ibdev cpulist possible address "
    "current_link_speed current_link_width aer_dev_fatal aer_dev_nonfatal aer_dev_correctable "
    "feature_id type id afu_id interface_id name speed product_name unique_id boot_vga "
    "compat_id bitstream_id ports_num mgmt_pf user_pf instance VBNV timestamp serial_num "
    "authorized devpath status device_type module_id serial_number "
    "reset core_count connected_devices arch_type instance_type device_name".split()
    # the PCI function a parentless char device drives (hailo_pci's hailo_chardev class)
    + "board_location".split()
    # NVIDIA vGPU VFs (vendor-specific VFIO): the type set and what can still be made
    + "current_vgpu_type creatable_vgpu_types".split()
    # amdgpu partition modes and memory; KFD topology nodes and links
    + "current_compute_partition current_memory_partition available_compute_partition "
    "available_memory_partition mem_info_vram_total properties gpu_id generation_id".split()
    # QAT PF services (qat/cfg_services; qat/state and heartbeat/status are named above) and
    # the switchdev port names the sriov driver tells representors by
    + "cfg_services phys_port_name".split()
)
# QAT firmware heartbeats live in debugfs (adf_heartbeat_dbgfs.c), one folder per PF: only
# those folders are walked, never the rest of debugfs.
_CAPTURE_GLOBS = ("/sys/kernel/debug/qat_*",)


def capture_tree(root: str = "/", dev_globs: Sequence[str] = ()) -> Iterator[str]:
    """Yield ``.tree`` lines for the parts of a real machine the built-in drivers read.

    Walks the sysfs roots above, follows their links into /sys/devices, records directories,
    the attribute files drivers use, and links; then the device nodes ``dev_globs`` match
    (``driver_dev_globs`` collects them from the drivers).
    """
    prefix = "" if root in ("", "/") else root.rstrip("/")
    seen: set = set()
    yield "# captured by device-plugin-host capture"
    pending = [r for r in _CAPTURE_ROOTS if os.path.lexists(prefix + r)]
    for pattern in _CAPTURE_GLOBS:
        pending.extend(sorted(real[len(prefix):] for real in glob.glob(prefix + pattern)))
    pending.append("/sys/devices/system/node")
    pending.append("/proc/driver/nvidia/gpus")
    while pending:
        host_path = pending.pop()
        if host_path in seen:
            continue
        seen.add(host_path)
        real = prefix + host_path
        if os.path.islink(real):
            target = os.readlink(real)
            yield f"l {host_path} -> {target}"
            resolved = posixpath.normpath(posixpath.join(posixpath.dirname(host_path), target))
            depth = host_path.count("/")
            if resolved.startswith("/sys/devices") and depth <= 6:
                pending.append(resolved)
            continue
        if os.path.isdir(real):
            yield f"d {host_path}"
            try:
                names = sorted(os.listdir(real))
            except OSError:
                continue
            for name in names:
                child = f"{host_path}/{name}"
                child_real = prefix + child
                if os.path.islink(child_real):
                    if name == "subsystem":
                        # Recorded, never followed: a class device's class (hailo_chardev,
                        # accel) is the last component of this link.
                        yield f"l {child} -> {os.readlink(child_real)}"
                        continue
                    if name in ("firmware_node", "consumer", "supplier"):
                        continue
                    pending.append(child)
                elif os.path.isdir(child_real):
                    if name in ("power", "msi_irqs", "link", "statistics", "queues", "hwmon"):
                        continue
                    if host_path.count("/") < 14:
                        pending.append(child)
                elif name in _CAPTURE_ATTRS or host_path.startswith("/proc/"):
                    try:
                        with open(child_real, encoding="utf-8", errors="replace") as handle:
                            yield f"f {child} {json.dumps(handle.read(65536).rstrip())}"
                    except OSError:
                        continue
    for pattern in dev_globs:
        for real in sorted(glob.glob(prefix + pattern)):
            host = real[len(prefix) :] if prefix else real
            if os.path.islink(real):  # /dev/dri/by-path/* and friends stay links
                yield f"l {host} -> {os.readlink(real)}"
                continue
            try:
                stat = os.stat(real)
            except OSError:
                continue
            if os.path.isdir(real):
                continue
            yield f"c {host} {os.major(stat.st_rdev)}:{os.minor(stat.st_rdev)}"


def driver_dev_globs(drivers: Iterable[object]) -> List[str]:
    """Every driver's ``device_globs``, once each, in driver order. A pattern that is not an
    absolute path under /dev (or that climbs out with "..") is skipped with a warning: capture
    must record device nodes, never read elsewhere because a driver said so."""
    out: List[str] = []
    for driver in drivers:
        name = getattr(driver, "name", "?")
        patterns = getattr(driver, "device_globs", ()) or ()
        if isinstance(patterns, str):
            patterns = (patterns,)
        for pattern in patterns:
            if (not isinstance(pattern, str) or not pattern.startswith("/dev/")
                    or ".." in pattern.split("/")):
                log.warning("driver %s: device glob %r is not a path under /dev/; skipped",
                            name, pattern)
                continue
            if pattern not in out:
                out.append(pattern)
    return out
