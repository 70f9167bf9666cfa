"""The DaemonSet's container as a podman command line: everything the kubelet would apply from
deploy/kubernetes/base/daemonset.yaml (command, user, securityContext, mounts, resources, the
liveness probe), read from the manifest, never restated.

Every field of the pod spec's securityContext, the container, its securityContext and its
volume mounts, and every volume kind, is either translated (HANDLED) or named with the reason
it has no podman counterpart (NOT_APPLICABLE); a field in neither raises ``Unhandled``, so a
new field in the manifest breaks the container run instead of being silently left out.
"""

from __future__ import annotations

import os
import re
import socket
import stat
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import yaml

REPO = Path(__file__).resolve().parents[2]
DAEMONSET = REPO / "deploy" / "kubernetes" / "base" / "daemonset.yaml"

HANDLED = {
    "pod": {"securityContext", "containers", "volumes", "hostNetwork"},
    "pod.securityContext": {"runAsUser", "runAsGroup", "seccompProfile"},
    "container": {"name", "image", "command", "args", "securityContext", "volumeMounts",
                  "resources", "livenessProbe", "ports", "env"},
    "env": {"name", "value", "valueFrom"},
    "container.securityContext": {"privileged", "allowPrivilegeEscalation",
                                  "readOnlyRootFilesystem", "capabilities", "runAsUser",
                                  "runAsGroup", "seccompProfile"},
    "volumeMount": {"name", "mountPath", "readOnly", "recursiveReadOnly"},
    "volume": {"hostPath", "configMap", "emptyDir"},
}
NOT_APPLICABLE = {
    "pod": {
        "priorityClassName": "scheduling and eviction order, a kubelet matter",
        "automountServiceAccountToken": "no service account outside a cluster",
        "enableServiceLinks": "no Services outside a cluster",
        "nodeSelector": "scheduling",
        "tolerations": "scheduling",
        "affinity": "scheduling",
    },
    "container": {
        "imagePullPolicy": "the image is in the local store",
        "terminationMessagePath": "the kubelet's termination message; podman keeps the logs",
        "terminationMessagePolicy": "the kubelet's termination message",
    },
}


class Unhandled(Exception):
    """A manifest field this translation does not know."""


@dataclass
class Plan:
    """podman run's options, the arguments after the image, and the liveness probe."""
    options: List[str] = field(default_factory=list)
    arguments: List[str] = field(default_factory=list)
    probe: Optional[Tuple[str, int]] = None  # (path, port) of the httpGet liveness probe
    mounts: Dict[str, Tuple[str, bool]] = field(default_factory=dict)  # path -> (host, ro)
    user: str = ""
    env: Dict[str, str] = field(default_factory=dict)


def pod_fields(namespace: str = "device-plugin-host") -> Dict[str, str]:
    """What the kubelet's downward API gives this pod's ``fieldRef`` env: a fresh uid per run
    (as each new pod of a rolling update has), the DaemonSet pod's name on this node, its
    namespace and this node's name."""
    node = socket.gethostname()
    return {"metadata.uid": str(uuid.uuid4()), "metadata.name": f"device-plugin-host-{node}",
            "metadata.namespace": namespace, "spec.nodeName": node}


def load(path: Path = DAEMONSET) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """The pod spec and its one container from the DaemonSet manifest."""
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    daemonsets = [d for d in docs if d.get("kind") == "DaemonSet"]
    if len(daemonsets) != 1:
        raise Unhandled(f"{path}: expected one DaemonSet, found {len(daemonsets)}")
    pod = daemonsets[0]["spec"]["template"]["spec"]
    if len(pod["containers"]) != 1:
        raise Unhandled("expected one container")
    return pod, pod["containers"][0]


def _check(kind: str, obj: Dict[str, Any]) -> None:
    unknown = set(obj) - HANDLED[kind] - set(NOT_APPLICABLE.get(kind, {}))
    if unknown:
        raise Unhandled(f"{kind}: no translation for {sorted(unknown)}")


def _quantity_mib(text: str) -> int:
    match = re.fullmatch(r"(\d+)(Mi|Gi)", str(text))
    if not match:
        raise Unhandled(f"memory quantity {text!r}")
    return int(match.group(1)) * (1024 if match.group(2) == "Gi" else 1)


def _cpus(text: str) -> str:
    text = str(text)
    return str(int(text[:-1]) / 1000) if text.endswith("m") else text


def plan(pod: Dict[str, Any], container: Dict[str, Any],
         host_path: Callable[[str], str], config_dir: str,
         fields: Optional[Dict[str, str]] = None) -> Plan:
    """The podman run options for ``container`` of ``pod``. ``host_path`` maps a hostPath
    volume's path to the directory that stands for it on this machine; ``config_dir`` holds
    what the configMap volume would (config.toml); ``fields`` answers the env's downward-API
    ``fieldRef`` paths (``pod_fields()`` when not given)."""
    _check("pod", pod)
    result = Plan()
    options = result.options
    fields = pod_fields() if fields is None else fields
    for item in container.get("env", []):
        _check("env", item)
        if "value" in item:
            value = str(item["value"])
        else:
            source = item.get("valueFrom", {})
            path = source.get("fieldRef", {}).get("fieldPath")
            if set(source) != {"fieldRef"} or path not in fields:
                raise Unhandled(f"env {item['name']}: no translation for {source}")
            value = fields[path]
        result.env[item["name"]] = value
        options += ["--env", f"{item['name']}={value}"]
    if pod.get("hostNetwork"):
        options += ["--network", "host"]
    else:
        # The pod's own network namespace: loopback only here (no CNI); the probe enters it.
        options += ["--network", "none"]
    pod_security = pod.get("securityContext", {})
    _check("pod.securityContext", pod_security)
    security = {**pod_security, **container.get("securityContext", {})}
    _check("container", container)
    _check("container.securityContext", container.get("securityContext", {}))
    user = security.get("runAsUser")
    group = security.get("runAsGroup")
    if user is not None:
        result.user = f"{user}:{group}" if group is not None else str(user)
        options += ["--user", result.user]
    seccomp = security.get("seccompProfile", {}).get("type", "RuntimeDefault")
    if seccomp == "Unconfined":
        options += ["--security-opt", "seccomp=unconfined"]
    elif seccomp != "RuntimeDefault":
        raise Unhandled(f"seccompProfile {seccomp}")
    if security.get("privileged"):
        options.append("--privileged")
    if security.get("allowPrivilegeEscalation") is False:
        options += ["--security-opt", "no-new-privileges"]
    if security.get("readOnlyRootFilesystem"):
        options += ["--read-only", "--read-only-tmpfs=false"]
    capabilities = security.get("capabilities", {})
    unknown = set(capabilities) - {"add", "drop"}
    if unknown:
        raise Unhandled(f"capabilities: {sorted(unknown)}")
    for cap in capabilities.get("drop", []):
        options += ["--cap-drop", cap]
    for cap in capabilities.get("add", []):
        options += ["--cap-add", cap]
    limits = container.get("resources", {}).get("limits", {})
    if "memory" in limits:
        options += ["--memory", f"{_quantity_mib(limits['memory'])}m"]
    if "cpu" in limits:
        options += ["--cpus", _cpus(limits["cpu"])]
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    for mount in container.get("volumeMounts", []):
        _check("volumeMount", mount)
        volume = volumes[mount["name"]]
        kinds = set(volume) - {"name"}
        _check("volume", {k: True for k in kinds})
        path = mount["mountPath"]
        read_only = bool(mount.get("readOnly"))
        if "hostPath" in volume:
            source = host_path(volume["hostPath"]["path"])
        elif "configMap" in volume:
            source, read_only = config_dir, True
        else:  # emptyDir
            size = volume["emptyDir"].get("sizeLimit")
            spec = f"{path}:rw,mode=1777" + (f",size={_quantity_mib(size)}m" if size else "")
            options += ["--tmpfs", spec]
            result.mounts[path] = ("tmpfs", False)
            continue
        # recursiveReadOnly: a fresh directory per path here carries no submounts to protect.
        options += ["--volume", f"{source}:{path}:{'ro' if read_only else 'rw'}"]
        result.mounts[path] = (source, read_only)
    if "command" in container:
        options += ["--entrypoint", container["command"][0]]
        result.arguments = [*container["command"][1:], *container.get("args", [])]
    else:
        result.arguments = list(container.get("args", []))
    probe = container.get("livenessProbe")
    if probe:
        http = probe.get("httpGet")
        if http is None:
            raise Unhandled("livenessProbe: only httpGet is translated")
        port = http["port"]
        if isinstance(port, str):
            named = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
            port = named[port]
        result.probe = (http.get("path", "/"), int(port))
    return result


def runtime_options() -> List[str]:
    """What podman needs on a machine like CI's beyond the manifest: runc (crun refuses cgroup
    v1's hybrid mode) and rlimits conmon can grant (podman asks for 1048576 open files, and
    root here lacks CAP_SYS_RESOURCE to raise a hard limit). DPH_OCI_RUNTIME picks another."""
    return ["--runtime", os.environ.get("DPH_OCI_RUNTIME", "runc"),
            "--ulimit", "nofile=4096:4096", "--ulimit", "nproc=4096:4096"]


def prepare_host_root(root: Path) -> None:
    """What a real host's /dev and /sys have and a fake tree lacks, and the runtime needs to
    start a container with both mounted read-only: the directories it mounts onto and the
    character devices it bind-mounts (null, zero, full, random, urandom)."""
    for name in ("dev/shm", "dev/pts", "dev/mqueue", "sys/fs/cgroup"):
        (root / name).mkdir(parents=True, exist_ok=True)
    for name, minor in (("null", 3), ("zero", 5), ("full", 7), ("random", 8), ("urandom", 9)):
        path = root / "dev" / name
        if not path.exists():
            os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, minor))


def host_dirs(root: Path) -> Callable[[str], str]:
    """A hostPath mapper for ``plan``: each host path becomes ROOT/path, created."""
    def host_path(path: str) -> str:
        local = root / path.lstrip("/")
        local.mkdir(parents=True, exist_ok=True)
        return str(local)
    return host_path
