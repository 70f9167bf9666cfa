"""What a container gets from CDI ids: the CDI library's injection, as containerd and CRI-O run it.

From tags.cncf.io/container-device-interface pkg/cdi:

* ``Cache.refresh``: every ``*.json`` / ``*.yaml`` spec of the spec directories is loaded; a
  qualified name (``vendor/class=name``) defined by two specs of the same directory is a
  conflict and resolves to no device at all;
* ``Cache.InjectDevices``: for each id in the order given, the spec-wide ``containerEdits`` of
  its spec (the first time a device of that spec is seen) and then the device's own edits are
  appended to one edit list; an id no spec defines fails the whole injection;
* ``ContainerEdits.Apply``: env through ``AddMultipleProcessEnv`` (a variable already present
  is replaced in place, a new one appended), each device node replaces one of the same path,
  each mount replaces one at the same container path and the mounts are then sorted stably by
  their number of path parts.

And from the kubelet (cm/dra manager ``GetResources``, claiminfo ``cdiDevicesAsList``): a
container's ids are, for each of the pod's claims in ``pod.spec.resourceClaims`` order that the
container references, the ids of the claim's devices whose request names include the
referenced request (every device for a whole-claim reference), in the plugin's answer order.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from host.sim.kubelet_dra.simulator import ClaimInfo

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]*$")


class CdiError(Exception):
    """What the runtime reports; the container is not created."""


@dataclass
class Container:
    """The parts of an OCI spec that CDI edits."""

    env: List[str] = field(default_factory=list)
    device_nodes: List[Dict[str, Any]] = field(default_factory=list)
    mounts: List[Dict[str, Any]] = field(default_factory=list)

    def environ(self) -> Dict[str, str]:
        return dict(entry.split("=", 1) for entry in self.env)

    def device_paths(self) -> List[str]:
        return sorted(node["path"] for node in self.device_nodes)


@dataclass
class _Spec:
    path: str
    edits: Dict[str, Any]


class CdiCache:
    """The devices of the spec directories, read once (``refresh`` reads them again)."""

    def __init__(self, *spec_dirs: str) -> None:
        self.spec_dirs = spec_dirs
        self.devices: Dict[str, Tuple[_Spec, Dict[str, Any]]] = {}
        self.errors: Dict[str, str] = {}
        self.refresh()

    def refresh(self) -> None:
        devices: Dict[str, Tuple[_Spec, Dict[str, Any]]] = {}
        conflicts: set = set()
        self.errors = {}
        for directory in self.spec_dirs:
            if not os.path.isdir(directory):
                continue
            seen_here: Dict[str, str] = {}
            for name in sorted(os.listdir(directory)):
                if not name.endswith((".json", ".yaml")):
                    continue
                path = os.path.join(directory, name)
                try:
                    with open(path, encoding="utf-8") as stream:
                        raw = json.load(stream)
                    spec, entries = _validate(path, raw)
                except (OSError, ValueError, KeyError, TypeError) as error:
                    self.errors[path] = str(error)
                    continue
                for qualified, device in entries:
                    if qualified in seen_here:  # same priority: neither wins
                        conflicts.add(qualified)
                    seen_here[qualified] = path
                    devices[qualified] = (spec, device)  # a later directory overrides
        for qualified in conflicts:
            devices.pop(qualified, None)
        self.devices = devices

    def inject(self, ids: Sequence[str], container: Optional[Container] = None) -> Container:
        container = container or Container()
        unresolved = [i for i in ids if i not in self.devices]
        if unresolved:
            raise CdiError(f"unresolvable CDI devices {', '.join(unresolved)}")
        edits: List[Dict[str, Any]] = []
        specs_seen: set = set()
        for qualified in ids:
            spec, device = self.devices[qualified]
            if spec.path not in specs_seen:
                specs_seen.add(spec.path)
                edits.append(spec.edits)
            edits.append(device.get("containerEdits") or {})
        _apply(container, edits)
        return container


def _validate(path: str, raw: Any) -> Tuple[_Spec, List[Tuple[str, Dict[str, Any]]]]:
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: not a CDI spec")
    kind = str(raw["kind"])
    vendor, _, klass = kind.partition("/")
    if not vendor or not klass:
        raise ValueError(f"{path}: invalid kind {kind!r}")
    spec = _Spec(path, raw.get("containerEdits") or {})
    _check_edits(path, spec.edits)
    entries = []
    for device in raw["devices"]:
        name = str(device["name"])
        if not _NAME.match(name) or not name[-1].isalnum():
            raise ValueError(f"{path}: invalid device name {name!r}")
        edits = device.get("containerEdits") or {}
        if not any(edits.get(k) for k in ("env", "deviceNodes", "hooks", "mounts",
                                          "additionalGids", "intelRdt", "netDevices")):
            raise ValueError(f"{path}: device {name!r} has empty containerEdits")
        _check_edits(path, edits)
        entries.append((f"{kind}={name}", device))
    return spec, entries


def _check_edits(path: str, edits: Dict[str, Any]) -> None:
    for entry in edits.get("env") or ():
        if str(entry).find("=") <= 0:
            raise ValueError(f"{path}: invalid environment variable {entry!r}")
    for node in edits.get("deviceNodes") or ():
        if not node.get("path"):
            raise ValueError(f"{path}: invalid (empty) device path")
    for mount in edits.get("mounts") or ():
        if not mount.get("hostPath") or not mount.get("containerPath"):
            raise ValueError(f"{path}: invalid mount {mount!r}")


def _apply(container: Container, edit_list: Sequence[Dict[str, Any]]) -> None:
    env: List[str] = []
    nodes: List[Dict[str, Any]] = []
    mounts: List[Dict[str, Any]] = []
    for edits in edit_list:  # ContainerEdits.Append
        env += list(edits.get("env") or ())
        nodes += list(edits.get("deviceNodes") or ())
        mounts += list(edits.get("mounts") or ())
    index = {entry.split("=", 1)[0]: i for i, entry in enumerate(container.env)}
    for entry in env:  # AddMultipleProcessEnv
        key = entry.split("=", 1)[0]
        if key in index:
            container.env[index[key]] = entry
        else:
            container.env.append(entry)
            index[key] = len(container.env) - 1
    for node in nodes:  # RemoveDevice + AddDevice
        container.device_nodes = [n for n in container.device_nodes
                                  if n["path"] != node["path"]] + [dict(node)]
    if mounts:
        for mount in mounts:  # RemoveMount + AddMount, then sortMounts
            container.mounts = [m for m in container.mounts
                                if m["containerPath"] != mount["containerPath"]] + [dict(mount)]
        container.mounts.sort(key=lambda m: os.path.normpath(m["containerPath"]).count("/"))


def container_cdi_ids(pod_claims: Sequence[Tuple[str, ClaimInfo]],
                      references: Sequence[Tuple[str, str]]) -> List[str]:
    """The kubelet's GetResources: ``pod_claims`` are (pod claim name, its prepared claim) in
    ``pod.spec.resourceClaims`` order, ``references`` the container's ``resources.claims``
    as (name, request), request "" for the whole claim."""
    ids: List[str] = []
    for pod_claim, info in pod_claims:
        for name, request in references:
            if name == pod_claim:
                ids.extend(info.cdi_devices(request))
    return ids
