"""One CDI spec file per prepared claim and resource, the names returned to the kubelet.

A DRA claim's devices reach the container only through CDI ids (the DRA protocol has no env,
mounts or device nodes of its own), so everything the device plugin side would put in an
Allocate response goes into the claim's spec: each device's own device nodes and mounts as
that device's edits, and the merged, driver-adjusted allocation (joined env such as
PCIDEVICE_*=a,b, device nodes or mounts the driver's allocate hook added) as the spec-wide
edits that apply once when any of its devices is injected. Annotations have no CDI container
field and are dropped. Device names carry the claim UID, so two claims never share an entry
and unprepare removes exactly its own file.
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Sequence, Set, Tuple

from host.cdi import cdi_kind, device_name
from host.dra.atomic import write_atomic
from host.model import ContainerAllocation, Device, DeviceNode, Mount

FILE_PREFIX = "device-plugin-host-claim_"


def spec_path(cdi_dir: str, claim_uid: str, resource: str) -> str:
    vendor, klass = cdi_kind(resource)
    return os.path.join(cdi_dir, f"{FILE_PREFIX}{claim_uid}_{vendor}-{klass}.json")


def entry_name(claim_uid: str, device: Device) -> str:
    return f"claim-{claim_uid}-{device_name(device.id)}"


def _node(node: DeviceNode) -> Tuple[Dict[str, Any], bool]:
    entry: Dict[str, Any] = {"path": node.container_path, "permissions": node.permissions}
    if node.host_path != node.container_path:
        entry["hostPath"] = node.host_path
        return entry, True
    return entry, False


def _mount(mount: Mount) -> Dict[str, Any]:
    options = ["ro" if mount.read_only else "rw", "nosuid", "nodev", "bind"]
    return {"hostPath": mount.host_path, "containerPath": mount.container_path,
            "options": options}


def build_claim_spec(
    claim_uid: str, resource: str, devices: Sequence[Device], merged: ContainerAllocation
) -> Tuple[Dict[str, Any], Dict[str, str]]:
    """(spec, {device id: fully qualified CDI id}) for one claim's devices of one resource."""
    vendor, klass = cdi_kind(resource)
    version = (0, 3, 0)
    own_nodes: Set[str] = set()
    own_mounts: Set[str] = set()
    entries: List[Dict[str, Any]] = []
    names: Dict[str, str] = {}
    for device in devices:
        edits: Dict[str, Any] = {}
        nodes = []
        for node in device.device_nodes:
            entry, needs_host_path = _node(node)
            if needs_host_path:
                version = max(version, (0, 5, 0))
            nodes.append(entry)
            own_nodes.add(node.container_path)
        if nodes:
            edits["deviceNodes"] = nodes
        if device.mounts:
            edits["mounts"] = [_mount(m) for m in device.mounts]
            own_mounts.update(m.container_path for m in device.mounts)
        if not edits:  # CDI wants non-empty edits on every device
            edits["env"] = [f"DEVICE_PLUGIN_HOST_CLAIM={claim_uid}"]
        name = entry_name(claim_uid, device)
        entries.append({"name": name, "containerEdits": edits})
        names[device.id] = f"{vendor}/{klass}={name}"
    shared: Dict[str, Any] = {}
    if merged.envs:
        shared["env"] = [f"{k}={v}" for k, v in sorted(merged.envs.items())]
    extra_nodes = []
    for node in merged.device_nodes:
        if node.container_path not in own_nodes:
            entry, needs_host_path = _node(node)
            if needs_host_path:
                version = max(version, (0, 5, 0))
            extra_nodes.append(entry)
    if extra_nodes:
        shared["deviceNodes"] = extra_nodes
    extra_mounts = [_mount(m) for m in merged.mounts if m.container_path not in own_mounts]
    if extra_mounts:
        shared["mounts"] = extra_mounts
    if "." in klass:
        version = max(version, (0, 6, 0))
    spec: Dict[str, Any] = {
        "cdiVersion": ".".join(map(str, version)),
        "kind": f"{vendor}/{klass}",
        "devices": entries,
    }
    if shared:
        spec["containerEdits"] = shared
    return spec, names


def write_claim_spec(path: str, spec: Dict[str, Any]) -> None:
    """Raises OSError; runtimes (and `cdi list`) must be able to read it: 0644."""
    write_atomic(path, json.dumps(spec, indent=2, sort_keys=True) + "\n", 0o644)
