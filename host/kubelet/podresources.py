"""Asking the kubelet which pod holds which device: a PodResources v1 client and ``pods``.

The kubelet is the only party that knows the pod behind an allocated device id (the device
plugin API never names pods), so operators and the allocated-device metric both come here.
The socket is rate limited (100 QPS, burst 10) and answers can be large on busy nodes, hence
one channel reused across calls, a 16 MiB receive limit and a per-call deadline; every failure
becomes a PodResourcesError whose text says what to do about it.
"""

from __future__ import annotations

import asyncio
import fnmatch
import json
import os
import stat
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import grpc

from host.kubelet.protocol import POD_RESOURCES_SOCKET, podresources, podresources_grpc

MAX_RECEIVE_BYTES = 16 * 1024 * 1024  # Go's 4 MiB default is too small for a busy node
DEFAULT_TIMEOUT_S = 5.0
RATE_LIMIT_HINT = "the kubelet allows 100 PodResources calls per second, burst 10"


class PodResourcesError(Exception):
    """A PodResources call that did not answer; ``code`` is None when no call was made."""

    def __init__(self, message: str, code: Optional[grpc.StatusCode] = None) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Assignment:
    """The devices of one resource held by one container, NUMA nodes per device."""

    namespace: str
    pod: str
    container: str
    resource: str
    devices: Tuple[str, ...]
    device_numa: Dict[str, Tuple[int, ...]] = field(default_factory=dict)

    @property
    def numa_nodes(self) -> Tuple[int, ...]:
        return tuple(sorted({n for nodes in self.device_numa.values() for n in nodes}))

    def record(self) -> Dict[str, Any]:
        """The JSON shape printed by ``pods --json``; scripts rely on these keys."""
        return {
            "pod": self.pod,
            "namespace": self.namespace,
            "container": self.container,
            "resource": self.resource,
            "devices": list(self.devices),
            "numa_nodes": list(self.numa_nodes),
            "device_numa": {d: list(self.device_numa.get(d, ())) for d in self.devices},
        }


def assignments(pods: Iterable[podresources.PodResources]) -> List[Assignment]:
    """Group the kubelet's one-id-per-entry ContainerDevices back into per-resource sets.

    The kubelet repeats an id once per NUMA node of the device (and once without topology
    when the plugin gave none), so ids are de-duplicated and their nodes merged.
    """
    out: List[Assignment] = []
    for pod in pods:
        for container in pod.containers:
            grouped: Dict[str, Dict[str, List[int]]] = {}
            for entry in container.devices:
                ids = grouped.setdefault(entry.resource_name, {})
                nodes = [node.ID for node in entry.topology.nodes]
                for device_id in entry.device_ids:
                    known = ids.setdefault(device_id, [])
                    known.extend(n for n in nodes if n not in known)
            for resource, ids in grouped.items():
                out.append(Assignment(
                    namespace=pod.namespace,
                    pod=pod.name,
                    container=container.name,
                    resource=resource,
                    devices=tuple(ids),
                    device_numa={d: tuple(sorted(n)) for d, n in ids.items()},
                ))
    out.sort(key=lambda a: (a.namespace, a.pod, a.container, a.resource))
    return out


def _explain(error: grpc.aio.AioRpcError, method: str, path: str, timeout: float) -> str:
    code = error.code()
    details = error.details() or ""
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return (f"the kubelet refused {method}: {details or 'rejected by rate limit'} "
                f"({RATE_LIMIT_HINT}); try again in a moment")
    if code == grpc.StatusCode.UNAVAILABLE:
        return (f"cannot reach the kubelet on {path}: {details}; is the kubelet running, and "
                f"may this process write to the socket (root, or the socket's group)?")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return f"the kubelet did not answer {method} within {timeout:g} s on {path}"
    if code == grpc.StatusCode.UNIMPLEMENTED:
        return (f"this kubelet does not serve {method} on {path} (Get needs 1.27+ with the "
                f"KubeletPodResourcesGet feature, GetAllocatableResources 1.21+)")
    return f"{method} failed: {code.name}: {details}"


def running_in_container(root: str = "/", environ: Optional[Mapping[str, str]] = None) -> bool:
    """Whether this process runs in a container rather than on the node itself: only there
    is "mount the kubelet's directory" the fix. Every pod has KUBERNETES_SERVICE_HOST; Docker
    leaves /.dockerenv, Podman /run/.containerenv, systemd-nspawn and Podman set
    ``container=``."""
    env = os.environ if environ is None else environ
    if env.get("KUBERNETES_SERVICE_HOST") or env.get("container"):
        return True
    return any(os.path.exists(os.path.join(root, marker))
               for marker in (".dockerenv", "run/.containerenv"))


def missing_socket_message(path: str, in_container: bool) -> str:
    parent = os.path.dirname(path) or "."
    if os.path.isdir(parent):
        where = ("the directory exists, so the kubelet is not serving it (not running, or "
                 "older than 1.15?)")
    elif in_container:
        where = f"{parent} is missing: mount the kubelet's pod-resources directory into this " \
                "container"
    else:
        where = (f"{parent} does not exist on this node: is the kubelet installed and running "
                 "here, or does it use another root directory (give its socket with --socket)?")
    return f"no pod-resources socket at {path}: {where}"


class PodResourcesClient:
    """One channel to the kubelet's pod-resources socket, reused for every call."""

    def __init__(
        self,
        socket_path: str = POD_RESOURCES_SOCKET,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        max_receive_bytes: int = MAX_RECEIVE_BYTES,
        in_container: Optional[bool] = None,
    ) -> None:
        self.socket_path = socket_path
        self.timeout_s = timeout_s
        self.max_receive_bytes = max_receive_bytes
        self.in_container = running_in_container() if in_container is None else in_container
        self._channel: Optional[grpc.aio.Channel] = None
        self._stub: Optional[podresources_grpc.PodResourcesListerStub] = None

    def check_socket(self) -> None:
        """Fail early, with a hint, instead of letting gRPC report a bare UNAVAILABLE."""
        path = self.socket_path
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise PodResourcesError(missing_socket_message(path, self.in_container)) from None
        except OSError as error:
            raise PodResourcesError(f"cannot use {path}: {error.strerror}") from None
        if not stat.S_ISSOCK(st.st_mode):
            raise PodResourcesError(f"{path} is not a socket")

    def _get_stub(self) -> podresources_grpc.PodResourcesListerStub:
        if self._stub is None:
            self._channel = grpc.aio.insecure_channel(
                "unix:" + os.path.abspath(self.socket_path),
                options=[
                    ("grpc.max_receive_message_length", self.max_receive_bytes),
                    ("grpc.enable_http_proxy", 0),
                ],
            )
            self._stub = podresources_grpc.PodResourcesListerStub(self._channel)
        return self._stub

    async def _call(self, method: str, request: Any) -> Any:
        self.check_socket()
        rpc = getattr(self._get_stub(), method)
        try:
            return await rpc(request, timeout=self.timeout_s)
        except grpc.aio.AioRpcError as error:
            raise PodResourcesError(
                _explain(error, method, self.socket_path, self.timeout_s), error.code()
            ) from None

    async def list(self) -> List[podresources.PodResources]:
        reply = await self._call("List", podresources.ListPodResourcesRequest())
        return list(reply.pod_resources)

    async def allocatable(self) -> List[podresources.ContainerDevices]:
        reply = await self._call("GetAllocatableResources",
                                 podresources.AllocatableResourcesRequest())
        return list(reply.devices)

    async def get(self, pod: str, namespace: str = "default") -> podresources.PodResources:
        reply = await self._call(
            "Get", podresources.GetPodResourcesRequest(pod_name=pod, pod_namespace=namespace)
        )
        return reply.pod_resources

    async def close(self) -> None:
        channel, self._channel, self._stub = self._channel, None, None
        if channel is not None:
            await channel.close()

    async def __aenter__(self) -> PodResourcesClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


# -- the ``pods`` command ---------------------------------------------------------------------
def select(rows: Sequence[Assignment], resource_filter: Optional[str]) -> List[Assignment]:
    """Exact resource name, or a shell pattern such as ``nvidia.com/*``."""
    if not resource_filter:
        return list(rows)
    return [r for r in rows if r.resource == resource_filter
            or fnmatch.fnmatchcase(r.resource, resource_filter)]


def format_table(rows: Sequence[Assignment]) -> List[str]:
    headers = ("POD", "NAMESPACE", "CONTAINER", "RESOURCE", "DEVICES", "NUMA")
    table = [
        (r.pod, r.namespace, r.container, r.resource, ",".join(r.devices),
         ",".join(str(n) for n in r.numa_nodes) or "-")
        for r in rows
    ]
    widths = [max([len(h)] + [len(row[i]) for row in table]) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in table]
    return lines


async def _fetch(socket_path: str, timeout_s: float,
                 in_container: Optional[bool]) -> List[Assignment]:
    async with PodResourcesClient(socket_path, timeout_s=timeout_s,
                                  in_container=in_container) as client:
        return assignments(await client.list())


def pods_main(socket_path: str, resource_filter: Optional[str], as_json: bool,
              timeout_s: float = DEFAULT_TIMEOUT_S, *,
              in_container: Optional[bool] = None) -> int:
    """``device-plugin-host pods``: 0 with the table (or JSON), 1 with a message on failure.
    ``in_container`` (detected when None) picks the hint for a missing socket directory."""
    try:
        rows = asyncio.run(_fetch(socket_path or POD_RESOURCES_SOCKET, timeout_s, in_container))
    except PodResourcesError as error:
        print(f"device-plugin-host pods: {error}", file=sys.stderr)
        return 1
    rows = select(rows, resource_filter)
    if as_json:
        json.dump([r.record() for r in rows], sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    for line in format_table(rows):
        print(line)
    if not rows:
        what = f" of {resource_filter}" if resource_filter else ""
        print(f"no running pod holds devices{what}", file=sys.stderr)
    return 0
