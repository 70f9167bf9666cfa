"""One CDI spec file per prepared claim and resource, the names returned to the kubelet.

A DRA claim's devices reach the container only through CDI ids (the DRA protocol has no env,
mounts or device nodes of its own), so everything the device plugin side would put in an
Allocate response goes into the claim's spec. The runtime (the CDI library containerd and
CRI-O use) applies, for each id a container receives, that device's ``containerEdits`` plus
the spec-wide ones, in order, a later value of a variable replacing an earlier one. The
kubelet hands a container the ids of the devices whose request names include the request it
references (all of the claim's devices for a whole-claim reference). So:

* each device's own entry carries its own device nodes, mounts and env;
* each request of the claim gets one more entry, listed after every device of that request,
  that carries what the driver made of that request's devices (its allocate hook runs per
  request): list-valued env joined over those devices (``VISIBLE=a,b``, ``PCIDEVICE_*``;
  ``RequestGroup.merged``, see below for containers with more devices), device nodes and
  mounts the hook added. A container referencing one request therefore ends with exactly its
  devices in every such variable;
* nothing goes into the spec-wide edits, which would reach every container that receives any
  device of the claim.

A variable set by two claims (or two requests of one claim that a container references whole)
is the last one injected, never a merge of both. So the service passes, for a request whose
referencing containers all receive the same devices of the driver over all their claims
(read from the claim's pods: host.dra.containers), the driver's merge of that union as the
request's env: every entry such a container receives then carries the same complete value.
Where they disagree (a claim shared by containers with different partner claims), or the pod
or a partner claim cannot be read, the request's own devices are listed (a warning, counted):
a container may then be told fewer devices than it received, never one it did not. A claim
already prepared for an earlier pod is not prepared again for a later one, so the later pod's
other claims never reach its entries. Annotations have no CDI container field and are
dropped.
Device names carry the claim UID, so two claims never share an entry and unprepare removes
exactly its own file; a share of a device (host.dra.sharing) has an entry of its own named
after its share id too, with the share's env (which share, how much of the device).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Sequence, Set, Tuple

from host.core.cdi import cdi_kind, device_name
from host.core.fileio import write_atomic
from host.core.model import ContainerAllocation, Device, DeviceNode, Mount

FILE_PREFIX = "device-plugin-host-claim_"


@dataclass(frozen=True)
class RequestGroup:
    """A claim's devices of one request in one pool, and what the driver made of them."""

    request: str  # the allocation result's request ("gpu", or "gpu/large" for a subrequest)
    devices: Sequence[Device]
    merged: ContainerAllocation
    # Parallel to ``devices`` where given: the share id of each ("" for a device used whole).
    share_ids: Sequence[str] = ()


def device_key(device: Device, share_id: str = "") -> str:
    """The key of ``build_claim_spec``'s ids: the device id, plus the share id of a share."""
    return f"{device.id}#share={share_id}" if share_id else device.id


def spec_path(cdi_dir: str, claim_uid: str, resource: str) -> str:
    vendor, klass = cdi_kind(resource)
    return os.path.join(cdi_dir, f"{FILE_PREFIX}{claim_uid}_{vendor}-{klass}.json")


def entry_name(claim_uid: str, device: Device, share_id: str = "") -> str:
    name = f"claim-{claim_uid}-{device_name(device.id)}"
    return f"{name}-share-{device_name(share_id)}" if share_id else name


def request_entry_name(claim_uid: str, request: str) -> str:
    """Apart from every device's entry: those have "-" right after the (fixed-length) UID."""
    return f"claim-{claim_uid}_request-{device_name(request or 'all')}"


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
    claim_uid: str, resource: str, groups: Sequence[RequestGroup]
) -> Tuple[Dict[str, Any], Dict[str, Tuple[str, ...]]]:
    """(spec, {device_key: its CDI ids in injection order}) for one claim's devices of one
    resource: the device's own id, its request's id where that has edits, then CDI names
    the driver's hook added."""
    vendor, klass = cdi_kind(resource)
    kind = f"{vendor}/{klass}"
    version = (0, 3, 0)
    entries: List[Dict[str, Any]] = []
    ids: Dict[str, Tuple[str, ...]] = {}
    for group in groups:
        own_nodes: Set[str] = set()
        own_mounts: Set[str] = set()
        names: List[Tuple[str, str]] = []
        share_ids = list(group.share_ids) or [""] * len(group.devices)
        for device, share_id in zip(group.devices, share_ids):
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
            if device.env:
                edits["env"] = [f"{k}={v}" for k, v in sorted(device.env.items())]
            if not edits:  # CDI wants non-empty edits on every device
                edits["env"] = [f"DEVICE_PLUGIN_HOST_CLAIM={claim_uid}"]
            name = entry_name(claim_uid, device, share_id)
            entries.append({"name": name, "containerEdits": edits})
            names.append((device_key(device, share_id), f"{kind}={name}"))
        shared: Dict[str, Any] = {}
        if group.merged.envs:
            shared["env"] = [f"{k}={v}" for k, v in sorted(group.merged.envs.items())]
        extra_nodes = []
        for node in group.merged.device_nodes:
            if node.container_path not in own_nodes:
                entry, needs_host_path = _node(node)
                if needs_host_path:
                    version = max(version, (0, 5, 0))
                extra_nodes.append(entry)
        if extra_nodes:
            shared["deviceNodes"] = extra_nodes
        extra_mounts = [_mount(m) for m in group.merged.mounts
                        if m.container_path not in own_mounts]
        if extra_mounts:
            shared["mounts"] = extra_mounts
        after: List[str] = []
        if shared:
            name = request_entry_name(claim_uid, group.request)
            entries.append({"name": name, "containerEdits": shared})
            after.append(f"{kind}={name}")
        after.extend(group.merged.cdi_devices)
        for device_id, own in names:
            ids[device_id] = tuple(dict.fromkeys([own, *after]))
    if "." in klass:
        version = max(version, (0, 6, 0))
    spec: Dict[str, Any] = {
        "cdiVersion": ".".join(map(str, version)),
        "kind": kind,
        "devices": entries,
    }
    return spec, ids


def write_claim_spec(path: str, spec: Dict[str, Any]) -> None:
    """Raises OSError; runtimes (and `cdi list`) must be able to read it: 0644."""
    write_atomic(path, json.dumps(spec, indent=2, sort_keys=True) + "\n", mode=0o644,
                 durable=True, make_dirs=True)
