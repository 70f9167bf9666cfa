"""NVIDIA MIG devices as the kernel driver shows them in procfs, without NVML.

A MIG device is a compute instance (CI) inside a GPU instance (GI) of a GPU in MIG mode. A
container can use it only with the parent GPU's nodes *and* the two capability nodes that
guard it, /dev/nvidia-caps/nvidia-cap<m> for the GI and for the CI. The driver (nv-caps.c)
publishes each capability as a procfs file::

    /proc/driver/nvidia/capabilities/gpu<N>/mig/gi<X>/access
    /proc/driver/nvidia/capabilities/gpu<N>/mig/gi<X>/ci<Y>/access

where N is the GPU's *device minor* (the N of /dev/nvidiaN, not nvidia-smi's index), present
while the instance exists, each reading ``DeviceFileMinor: <m>`` (plus mode lines). The static
table /proc/driver/nvidia-caps/mig-minors (``gpu<N>/gi<X>/access <m>`` lines) says the same
for every possible capability; nvidia-container-toolkit reads that one. Both are read here:
the access file for "this instance exists now", the table to fill in or cross-check its
minor. Profile names ("1g.10gb") and MIG UUIDs are not in procfs: only NVML knows them.
"""

from __future__ import annotations

import re
from typing import Dict, List, NamedTuple, Optional, Tuple

from device_plugin_host import HostFS

CAPABILITIES = "/proc/driver/nvidia/capabilities"
MIG_MINORS = "/proc/driver/nvidia-caps/mig-minors"
CAPS_DEV = "/dev/nvidia-caps"

_GPU = re.compile(r"gpu(\d+)\Z")
_GI = re.compile(r"gi(\d+)\Z")
_CI = re.compile(r"ci(\d+)\Z")
_TABLE = re.compile(r"gpu(\d+)/gi(\d+)(?:/ci(\d+))?/access\Z")


class MigDevice(NamedTuple):
    gpu_minor: int
    gi: int
    ci: int
    gi_cap: Optional[int]  # minor of /dev/nvidia-caps/nvidia-cap<m> for the GPU instance
    ci_cap: Optional[int]
    problems: Tuple[str, ...]

    @property
    def cap_nodes(self) -> Tuple[str, ...]:
        return tuple(f"{CAPS_DEV}/nvidia-cap{m}" for m in (self.gi_cap, self.ci_cap)
                     if m is not None)


def parse_mig_minors(text: str) -> Dict[Tuple[int, int, Optional[int]], int]:
    """(gpu minor, gi, ci or None) -> cap minor, from the mig-minors table."""
    table: Dict[Tuple[int, int, Optional[int]], int] = {}
    for line in text.splitlines():
        name, _, value = line.strip().partition(" ")
        match = _TABLE.match(name)
        if match is None or not value.strip().isdigit():
            continue
        ci = match.group(3)
        table[(int(match.group(1)), int(match.group(2)), int(ci) if ci else None)] = int(value)
    return table


def access_minor(text: Optional[str]) -> Optional[int]:
    for line in (text or "").splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "DeviceFileMinor" and value.strip().isdigit():
            return int(value.strip())
    return None


def mig_gpu_minors(host: HostFS) -> List[int]:
    """GPU minors with at least one GPU instance: in MIG mode as far as procfs can tell."""
    out = []
    for name in host.listdir(CAPABILITIES):
        match = _GPU.match(name)
        if match and any(_GI.match(g) for g in host.listdir(f"{CAPABILITIES}/{name}/mig")):
            out.append(int(match.group(1)))
    return sorted(out)


def read_mig_devices(host: HostFS) -> Dict[int, List[MigDevice]]:
    """Every MIG device procfs lists, per parent GPU minor, in (gi, ci) order."""
    table_text = host.read(MIG_MINORS)
    table = parse_mig_minors(table_text or "")
    out: Dict[int, List[MigDevice]] = {}
    for gpu in mig_gpu_minors(host):
        base = f"{CAPABILITIES}/gpu{gpu}/mig"
        devices = []
        for gi_name in host.listdir(base):
            gi_match = _GI.match(gi_name)
            if gi_match is None:
                continue
            gi = int(gi_match.group(1))
            gi_dir = f"{base}/{gi_name}"
            gi_cap, gi_problems = _cap(host, f"{gi_dir}/access", table, (gpu, gi, None),
                                       table_text is not None)
            for ci_name in host.listdir(gi_dir):
                ci_match = _CI.match(ci_name)
                if ci_match is None:
                    continue
                ci = int(ci_match.group(1))
                ci_cap, ci_problems = _cap(host, f"{gi_dir}/{ci_name}/access", table,
                                           (gpu, gi, ci), table_text is not None)
                devices.append(MigDevice(gpu, gi, ci, gi_cap, ci_cap,
                                         tuple(gi_problems + ci_problems)))
        out[gpu] = sorted(devices, key=lambda d: (d.gi, d.ci))
    return out


def _cap(
    host: HostFS,
    access: str,
    table: Dict[Tuple[int, int, Optional[int]], int],
    key: Tuple[int, int, Optional[int]],
    have_table: bool,
) -> Tuple[Optional[int], List[str]]:
    """The cap minor from the access file, checked against the table (either alone will do;
    two different answers mean the node could guard another instance: refuse)."""
    own = access_minor(host.read(access))
    listed = table.get(key)
    if own is not None and listed is not None and own != listed:
        return None, [f"{access} says minor {own} but {MIG_MINORS} says {listed}"]
    minor = own if own is not None else listed
    if minor is None:
        where = f"{access} has no DeviceFileMinor"
        if not have_table:
            where += f" and {MIG_MINORS} is not readable"
        return None, [where]
    return minor, []
