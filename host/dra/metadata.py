"""Device metadata files (KEP-5304): the allocated devices' attributes, inside the container.

Off unless ``[host] dra_device_metadata`` names a version. Layout and format are upstream's
(k8s.io/dynamic-resource-allocation kubeletplugin/metadata.go, api/metadata), so consumers
built on its ``devicemetadata`` package read ours:

* per base request of a prepared claim (a subrequest "gpu/large" is written under "gpu"),
  a file ``<plugin data dir>/dra-device-metadata/<namespace>_<claim>/<request>/metadata.json``
  (the plugin data dir is ``<dra_plugins_dir>/<driver>``, beside the DRA socket): a JSON
  stream of one ``DeviceMetadata`` object per configured version (apiVersion
  ``metadata.resource.k8s.io/<version>``), with the claim's name, namespace and uid, a
  ``generation`` of 1, ``podClaimName`` where the claim came from a template (its
  ``resource.kubernetes.io/pod-claim-name`` annotation), and one request with its devices:
  driver, pool, name, and the attributes their slice publishes;
* a CDI spec ``<cdi_dir>/<driver>_metadata_<claim uid>_<request>.json`` (kind
  ``<driver>/metadata``, device ``<claim uid>_<request>``) that bind-mounts that file read-only
  at ``/var/run/kubernetes.io/dra-device-attributes/resourceclaims/<claim>/<request>/
  <driver>-metadata.json``, or under ``resourceclaimtemplates/<pod claim name>/`` for a claim
  made from a template;
* that CDI id is added to the first device of the request, as upstream's helper does, so
  every container that gets the request's devices gets the file.

Files are written as root without following symlinks (host/core/fileio.py), 0644 files and 0755
directories, as upstream's; unprepare removes the claim's directory and its specs.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from host.core import fileio
from host.core.model import Device
from host.dra.slices import device_attributes

GROUP = "metadata.resource.k8s.io"
VERSIONS = ("v1alpha1",)
SUB_DIR = "dra-device-metadata"
CONTAINER_DIR = "/var/run/kubernetes.io/dra-device-attributes"
POD_CLAIM_ANNOTATION = "resource.kubernetes.io/pod-claim-name"
FILE_MODE = 0o644
DIR_MODE = 0o755


@dataclass(frozen=True)
class MetadataDevice:
    pool: str
    name: str
    device: Device


def base_request(request: str) -> str:
    return request.split("/", 1)[0]


def claim_dir(data_dir: str, namespace: str, name: str) -> str:
    return os.path.join(data_dir, SUB_DIR, f"{namespace}_{name}")


def file_path(data_dir: str, namespace: str, name: str, request: str) -> str:
    return os.path.join(claim_dir(data_dir, namespace, name), request, "metadata.json")


def spec_path(cdi_dir: str, driver: str, uid: str, request: str) -> str:
    return os.path.join(cdi_dir, f"{driver}_metadata_{uid}_{request}.json")


def container_path(driver: str, claim: str, request: str,
                   pod_claim: Optional[str] = None) -> str:
    if pod_claim:
        return os.path.join(CONTAINER_DIR, "resourceclaimtemplates", pod_claim, request,
                            f"{driver}-metadata.json")
    return os.path.join(CONTAINER_DIR, "resourceclaims", claim, request,
                        f"{driver}-metadata.json")


def pod_claim_name(claim: Mapping[str, Any]) -> Optional[str]:
    annotations = (claim.get("metadata") or {}).get("annotations") or {}
    value = annotations.get(POD_CLAIM_ANNOTATION)
    return str(value) if value else None


def document(driver: str, claim: Mapping[str, Any], request: str,
             devices: Sequence[MetadataDevice], versions: Sequence[str]) -> str:
    """The file's text: the same DeviceMetadata once per version, newest first."""
    meta = claim.get("metadata") or {}
    objects = []
    for version in versions:
        obj: Dict[str, Any] = {
            "kind": "DeviceMetadata", "apiVersion": f"{GROUP}/{version}",
            "metadata": {"name": meta.get("name"), "namespace": meta.get("namespace"),
                         "uid": meta.get("uid"), "generation": 1},
        }
        pod_claim = pod_claim_name(claim)
        if pod_claim:
            obj["podClaimName"] = pod_claim
        entries = []
        for item in devices:
            entry: Dict[str, Any] = {"driver": driver, "pool": item.pool, "name": item.name}
            attributes = device_attributes(item.device)
            if attributes:
                entry["attributes"] = attributes
            entries.append(entry)
        obj["requests"] = [{"name": request, "devices": entries}]
        objects.append(json.dumps(obj, indent=2, sort_keys=True))
    return "\n".join(objects) + "\n"


def cdi_spec(driver: str, uid: str, request: str, host_file: str,
             in_container: str) -> Tuple[Dict[str, Any], str]:
    """(the spec, the qualified CDI id of its one device)."""
    name = f"{uid}_{request}"
    spec = {"cdiVersion": "0.5.0", "kind": f"{driver}/metadata", "devices": [{
        "name": name, "containerEdits": {"mounts": [{
            "hostPath": host_file, "containerPath": in_container, "options": ["ro", "bind"]}]}}]}
    return spec, f"{driver}/metadata={name}"


def _make_dirs(top: str, path: str) -> None:
    """``path`` and the directories between ``top`` and it, 0755, refusing a symlink on the
    way (a directory someone else made a link could send our root-written file elsewhere)."""
    os.makedirs(top, mode=DIR_MODE, exist_ok=True)
    relative = os.path.relpath(path, top)
    current = top
    for part in [] if relative == "." else relative.split(os.sep):
        current = os.path.join(current, part)
        try:
            os.mkdir(current, DIR_MODE)
            os.chmod(current, DIR_MODE)  # whatever the umask
        except FileExistsError:
            pass
        info = os.lstat(current)
        if not stat.S_ISDIR(info.st_mode):
            raise OSError(f"{current} is not a directory (a symlink?)")


def write_request(data_dir: str, cdi_dir: str, driver: str, claim: Mapping[str, Any],
                  request: str, request_ref: str, devices: Sequence[MetadataDevice],
                  versions: Sequence[str]) -> Tuple[List[str], Dict[str, Any], str]:
    """Write one request's metadata file and CDI spec; returns (files written, {spec path:
    spec}, the CDI id). Raises OSError."""
    meta = claim.get("metadata") or {}
    namespace, name, uid = str(meta.get("namespace")), str(meta.get("name")), str(meta["uid"])
    host_file = file_path(data_dir, namespace, name, request)
    _make_dirs(os.path.join(data_dir, SUB_DIR), os.path.dirname(host_file))
    fileio.write_atomic(host_file, document(driver, claim, request_ref, devices, versions),
                        mode=FILE_MODE, durable=True)
    spec, cdi_id = cdi_spec(driver, uid, request, host_file,
                            container_path(driver, name, request, pod_claim_name(claim)))
    path = spec_path(cdi_dir, driver, uid, request)
    os.makedirs(cdi_dir, mode=DIR_MODE, exist_ok=True)
    fileio.write_atomic(path, json.dumps(spec, indent=2, sort_keys=True) + "\n",
                        mode=FILE_MODE, durable=True)
    return [host_file, path], {path: spec}, cdi_id


def remove_claim(data_dir: str, namespace: str, name: str) -> None:
    """The claim's metadata directory (its specs go with the claim's other CDI files).
    Raises OSError; one already gone is fine."""
    directory = claim_dir(data_dir, namespace, name)
    try:
        info = os.lstat(directory)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(info.st_mode):
        os.unlink(directory)
        return
    shutil.rmtree(directory)
