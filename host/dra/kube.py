"""A small async client for the few Kubernetes API calls the host makes.

It is built on httpx rather than the official clients (kubernetes is synchronous; both it
and kubernetes-asyncio import hundreds of modules). We need six REST calls on raw JSON (the
publisher compares JSON, the DRA service reads
status.allocation as JSON), so generated model classes would only be converted back. httpx is
async, well kept, does TLS through the standard ssl module, pools connections and has timeouts.

Configuration follows client-go's rules: in-cluster (KUBERNETES_SERVICE_HOST/PORT, the service
account token re-read at least every minute and after a 401, as client-go's cached token
source does, because the kubelet rotates projected tokens; the CA bundle of the service
account), or a kubeconfig file (current-context; server, certificate-authority[-data],
insecure-skip-tls-verify, token, tokenFile, client-certificate[-data]/client-key[-data]; paths
relative to the file).
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import ssl
import tempfile
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Dict, List, Mapping, Optional, Tuple

import httpx

RESOURCE_API = "/apis/resource.k8s.io/v1"
SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
TOKEN_REREAD_S = 60.0
DEFAULT_TIMEOUT_S = 10.0
# A watch asks the server to end it after this long (it is then started again from the last
# resourceVersion seen); a silent connection is given up a little after that.
WATCH_TIMEOUT_S = 300


# Every (verb, API group, resource) KubeClient calls: the DaemonSet's RBAC must grant these
# (tests/test_deploy_dra.py holds the dra overlay's ClusterRole to it).
API_ACCESS = (
    ("get", "", "nodes"),
    ("list", "", "nodes"),
    ("watch", "", "nodes"),
    ("get", "", "pods"),
    ("get", "resource.k8s.io", "resourceclaims"),
    ("list", "resource.k8s.io", "resourceslices"),
    ("watch", "resource.k8s.io", "resourceslices"),
    ("get", "resource.k8s.io", "resourceslices"),
    ("create", "resource.k8s.io", "resourceslices"),
    ("update", "resource.k8s.io", "resourceslices"),
    ("delete", "resource.k8s.io", "resourceslices"),
)


class KubeConfigError(Exception):
    """No usable API access configuration: one line for the operator, exit 2 at start-up."""


class KubeError(Exception):
    """A failed API call. ``status`` 0 means no HTTP answer (refused, reset, timed out).

    ``reason`` is the Status reason ("Conflict", "Invalid", "NotFound", ...) or "Unavailable";
    ``message`` is the server's own text, which is what an operator needs to see for a 422.
    """

    def __init__(self, status: int, reason: str, message: str = "",
                 causes: Optional[List[Dict[str, Any]]] = None,
                 retry_after_s: Optional[float] = None) -> None:
        super().__init__(f"{status} {reason}: {message}" if message else f"{status} {reason}")
        self.status = status
        self.reason = reason
        self.message = message
        self.causes = causes or []
        # The server's Retry-After (429 from API Priority and Fairness, some 5xx), seconds.
        self.retry_after_s = retry_after_s


@dataclass
class ClusterAccess:
    """Where the API server is and how we prove who we are; built once at start-up."""

    server: str
    ssl_context: Any  # ssl.SSLContext, or False for plain http (the stand-in)
    token: Optional[str] = None
    token_file: Optional[str] = None


class _Token:
    """The bearer token, re-read from its file when a minute old or after a 401."""

    def __init__(self, token: Optional[str], token_file: Optional[str]) -> None:
        self._static = token
        self._file = token_file
        self._value: Optional[str] = token
        self._read_at = 0.0

    def get(self, force: bool = False) -> Optional[str]:
        if self._file is None:
            return self._static
        now = time.monotonic()
        if force or self._value is None or now - self._read_at >= TOKEN_REREAD_S:
            try:
                # A few hundred bytes from tmpfs: cheaper than handing it to a thread.
                with open(self._file, encoding="utf-8") as handle:
                    self._value = handle.read().strip()
                self._read_at = now
            except OSError as err:
                if self._value is None:
                    raise KubeError(0, "Unauthorized", f"token file {self._file}: {err}") from err
        return self._value

    @property
    def rereadable(self) -> bool:
        return self._file is not None


def _ssl_context(ca_file: Optional[str] = None, ca_data: Optional[str] = None,
                 insecure: bool = False, cert_file: Optional[str] = None,
                 key_file: Optional[str] = None, cert_data: Optional[bytes] = None,
                 key_data: Optional[bytes] = None) -> ssl.SSLContext:
    if insecure:
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    elif ca_file or ca_data:
        ctx = ssl.create_default_context(cafile=ca_file, cadata=ca_data)
    else:
        ctx = ssl.create_default_context()
    if cert_data is not None and key_data is not None:
        # ssl loads client certificates from files only: a private directory, gone at once.
        tmp = tempfile.mkdtemp(prefix="dph-kube-")
        try:
            cert_path = os.path.join(tmp, "cert.pem")
            key_path = os.path.join(tmp, "key.pem")
            for path, data in ((cert_path, cert_data), (key_path, key_data)):
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "wb") as handle:
                    handle.write(data)
            ctx.load_cert_chain(cert_path, key_path)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    elif cert_file and key_file:
        ctx.load_cert_chain(cert_file, key_file)
    return ctx


def in_cluster_access(env: Optional[Mapping[str, str]] = None,
                      sa_dir: str = SERVICE_ACCOUNT_DIR) -> ClusterAccess:
    """client-go's InClusterConfig: the service's env variables and the mounted account."""
    env = os.environ if env is None else env
    host = env.get("KUBERNETES_SERVICE_HOST", "")
    port = env.get("KUBERNETES_SERVICE_PORT", "")
    if not host or not port:
        raise KubeConfigError(
            "no kubeconfig configured and not in a cluster "
            "(KUBERNETES_SERVICE_HOST/KUBERNETES_SERVICE_PORT are not set)")
    token_file = os.path.join(sa_dir, "token")
    ca_file = os.path.join(sa_dir, "ca.crt")
    if not os.path.isfile(token_file):
        raise KubeConfigError(f"in-cluster: no service account token at {token_file}")
    try:
        ctx = _ssl_context(ca_file=ca_file) if os.path.isfile(ca_file) else _ssl_context()
    except (OSError, ssl.SSLError) as err:
        raise KubeConfigError(f"in-cluster: CA bundle {ca_file}: {err}") from err
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return ClusterAccess(server=f"https://{host}:{port}", ssl_context=ctx, token_file=token_file)


def _named(items: Any, name: str, kind: str, path: str) -> Dict[str, Any]:
    for item in items or []:
        if isinstance(item, dict) and item.get("name") == name:
            return item.get(kind) or {}
    raise KubeConfigError(f"{path}: {kind} {name!r} not found")


def kubeconfig_access(path: str) -> ClusterAccess:
    """The current context of a kubeconfig file (no merging of several files)."""
    import yaml  # only here: the DaemonSet runs in-cluster

    try:
        with open(path, encoding="utf-8") as handle:
            doc = yaml.safe_load(handle)
    except OSError as err:
        raise KubeConfigError(f"{path}: {err.strerror or err}") from err
    except yaml.YAMLError as err:
        raise KubeConfigError(f"{path}: not valid YAML: {err}") from err
    if not isinstance(doc, dict):
        raise KubeConfigError(f"{path}: not a kubeconfig (no mapping at the top)")
    base = os.path.dirname(os.path.abspath(path))

    def rel(value: Optional[str]) -> Optional[str]:
        return value if not value or os.path.isabs(value) else os.path.join(base, value)

    current = doc.get("current-context")
    if not current:
        raise KubeConfigError(f"{path}: current-context is not set")
    context = _named(doc.get("contexts"), current, "context", path)
    cluster = _named(doc.get("clusters"), context.get("cluster", ""), "cluster", path)
    user: Dict[str, Any] = {}
    if context.get("user"):
        user = _named(doc.get("users"), context["user"], "user", path)
    for plugin in ("exec", "auth-provider"):
        if user.get(plugin) and not (user.get("token") or user.get("tokenFile")
                                     or user.get("client-certificate")
                                     or user.get("client-certificate-data")):
            # Running a credential plugin (cloud CLIs) is not something a node agent should
            # do; say so rather than sending no credentials and failing with a 401.
            raise KubeConfigError(
                f"{path}: user {context['user']!r} uses an {plugin} credential plugin, which "
                "the host does not run; give it a token, tokenFile or client certificate")
    server = str(cluster.get("server") or "").rstrip("/")
    if not server.startswith(("https://", "http://")):
        raise KubeConfigError(f"{path}: cluster {context.get('cluster')!r}: server "
                              f"{server!r} is not an http(s) URL")

    def data(key: str) -> Optional[bytes]:
        value = user.get(key) if key.startswith("client") else cluster.get(key)
        if not value:
            return None
        try:
            return base64.b64decode(value)
        except ValueError as err:
            raise KubeConfigError(f"{path}: {key} is not base64") from err

    try:
        ctx: Any = False
        if server.startswith("https://"):
            ca_data = data("certificate-authority-data")
            ctx = _ssl_context(
                ca_file=rel(cluster.get("certificate-authority")),
                ca_data=ca_data.decode() if ca_data else None,
                insecure=bool(cluster.get("insecure-skip-tls-verify")),
                cert_file=rel(user.get("client-certificate")),
                key_file=rel(user.get("client-key")),
                cert_data=data("client-certificate-data"),
                key_data=data("client-key-data"))
    except (OSError, ssl.SSLError) as err:
        raise KubeConfigError(f"{path}: TLS material: {err}") from err
    token_file = rel(user.get("tokenFile"))
    if token_file and not os.path.isfile(token_file):
        raise KubeConfigError(f"{path}: tokenFile {token_file} does not exist")
    return ClusterAccess(server=server, ssl_context=ctx, token=user.get("token") or None,
                         token_file=token_file)


def _error_from(response: httpx.Response) -> KubeError:
    reason = response.reason_phrase or "Error"
    message = response.text[:2000]
    causes: List[Dict[str, Any]] = []
    try:
        body = response.json()
    except ValueError:
        body = None
    if isinstance(body, dict) and body.get("kind") == "Status":
        reason = str(body.get("reason") or reason)
        message = str(body.get("message") or message)
        details = body.get("details") or {}
        causes = list(details.get("causes") or [])
    retry_after: Optional[float] = None
    header = response.headers.get("retry-after")
    if header and header.strip().isdigit():
        retry_after = float(header.strip())
    return KubeError(response.status_code, reason, message, causes, retry_after)


class KubeClient:
    """The host's calls to the API server; every method is a coroutine on the caller's loop."""

    def __init__(self, access: ClusterAccess, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.server = access.server
        self._token = _Token(access.token, access.token_file)
        self._http = httpx.AsyncClient(
            base_url=access.server, verify=access.ssl_context,
            timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 5.0)),
            headers={"Accept": "application/json", "User-Agent": "device-plugin-host"},
            trust_env=False)

    @classmethod
    def from_settings(cls, kubeconfig: Optional[str],
                      timeout_s: float = DEFAULT_TIMEOUT_S) -> KubeClient:
        """A kubeconfig path (node package), or None for the in-cluster service account."""
        access = kubeconfig_access(kubeconfig) if kubeconfig else in_cluster_access()
        return cls(access, timeout_s)

    async def close(self) -> None:
        await self._http.aclose()

    async def _call(self, method: str, path: str, body: Optional[Dict[str, Any]] = None,
                    params: Optional[Dict[str, str]] = None) -> Any:
        content = json.dumps(body, separators=(",", ":")).encode() if body is not None else None
        for attempt in (0, 1):
            headers = {}
            token = self._token.get(force=attempt == 1)
            if token:
                headers["Authorization"] = f"Bearer {token}"
            if content is not None:
                headers["Content-Type"] = "application/json"
            try:
                response = await self._http.request(method, path, content=content,
                                                    params=params, headers=headers)
            except httpx.TimeoutException as err:
                raise KubeError(0, "Timeout", f"{method} {path}: {err!r}") from err
            except httpx.RequestError as err:  # transport, decoding, redirects
                raise KubeError(0, "Unavailable", f"{method} {path}: {err!r}") from err
            if response.status_code == 401 and attempt == 0 and self._token.rereadable:
                continue  # the kubelet may just have rotated the projected token
            if response.status_code >= 400:
                raise _error_from(response)
            if not response.content:
                return None
            try:
                return response.json()
            except ValueError as err:
                raise KubeError(response.status_code, "BadResponse",
                                f"{method} {path}: not JSON") from err
        raise AssertionError("unreachable")

    async def get_node(self, name: str) -> Dict[str, Any]:
        return await self._call("GET", f"/api/v1/nodes/{name}")

    async def get_pod(self, namespace: str, name: str) -> Dict[str, Any]:
        return await self._call("GET", f"/api/v1/namespaces/{namespace}/pods/{name}")

    async def get_resource_claim(self, namespace: str, name: str) -> Dict[str, Any]:
        return await self._call(
            "GET", f"{RESOURCE_API}/namespaces/{namespace}/resourceclaims/{name}")

    async def list_resource_slices(self, driver: str, node_name: str) -> List[Dict[str, Any]]:
        return (await self.list_slices_at(node_name, driver))[0]

    async def list_slices_at(self, node_name: str, driver: Optional[str] = None
                             ) -> Tuple[List[Dict[str, Any]], str]:
        """The node's ResourceSlices (of ``driver`` only, if given) and the list's
        resourceVersion: the revision they were read at, to watch from."""
        selector = f"spec.nodeName={node_name}"
        if driver is not None:
            selector = f"spec.driver={driver},{selector}"
        result = await self._call("GET", f"{RESOURCE_API}/resourceslices",
                                  params={"fieldSelector": selector})
        result = result or {}
        version = str((result.get("metadata") or {}).get("resourceVersion") or "")
        return list(result.get("items") or []), version

    async def watch_node_slices(self, node_name: str, resource_version: Optional[str],
                                timeout_s: int = WATCH_TIMEOUT_S
                                ) -> AsyncIterator[Dict[str, Any]]:
        """The watch events ({"type", "object"}) of the node's ResourceSlices after
        ``resource_version``, until the server ends the watch. An ERROR event (410 Expired
        after compaction) is raised as KubeError with the Status's code."""
        async for event in self._watch(f"{RESOURCE_API}/resourceslices",
                                       f"spec.nodeName={node_name}", resource_version,
                                       timeout_s):
            yield event

    async def list_nodes_named(self, name: str) -> Tuple[List[Dict[str, Any]], str]:
        """The Node called ``name`` as a list (empty while it does not exist) and the list's
        resourceVersion, to watch from: an informer's list, for one object."""
        result = await self._call("GET", "/api/v1/nodes",
                                  params={"fieldSelector": f"metadata.name={name}"})
        result = result or {}
        version = str((result.get("metadata") or {}).get("resourceVersion") or "")
        return list(result.get("items") or []), version

    async def watch_node(self, name: str, resource_version: Optional[str],
                         timeout_s: int = WATCH_TIMEOUT_S) -> AsyncIterator[Dict[str, Any]]:
        """The watch events of the Node called ``name`` after ``resource_version`` (see
        ``watch_node_slices`` for the contract)."""
        async for event in self._watch("/api/v1/nodes", f"metadata.name={name}",
                                       resource_version, timeout_s):
            yield event

    async def _watch(self, path: str, field_selector: str, resource_version: Optional[str],
                     timeout_s: int) -> AsyncIterator[Dict[str, Any]]:
        params = {"fieldSelector": field_selector, "watch": "true",
                  "allowWatchBookmarks": "true", "timeoutSeconds": str(timeout_s)}
        if resource_version:
            params["resourceVersion"] = resource_version
        timeout = httpx.Timeout(10.0, read=timeout_s + 30.0)
        for attempt in (0, 1):
            headers = {}
            token = self._token.get(force=attempt == 1)
            if token:
                headers["Authorization"] = f"Bearer {token}"
            try:
                async with self._http.stream("GET", path, params=params, headers=headers,
                                             timeout=timeout) as response:
                    if response.status_code == 401 and attempt == 0 and \
                            self._token.rereadable:
                        continue
                    if response.status_code >= 400:
                        await response.aread()
                        raise _error_from(response)
                    async for line in response.aiter_lines():
                        if not line.strip():
                            continue
                        try:
                            event = json.loads(line)
                        except ValueError as err:
                            raise KubeError(response.status_code, "BadResponse",
                                            f"watch {path}: not JSON") from err
                        if event.get("type") == "ERROR":
                            status = event.get("object") or {}
                            raise KubeError(int(status.get("code") or 500),
                                            str(status.get("reason") or "Error"),
                                            str(status.get("message") or ""))
                        yield event
                    return
            except httpx.TimeoutException as err:
                raise KubeError(0, "Timeout", f"watch {path}: {err!r}") from err
            except httpx.RequestError as err:
                raise KubeError(0, "Unavailable", f"watch {path}: {err!r}") from err

    async def create_resource_slice(self, obj: Dict[str, Any]) -> Dict[str, Any]:
        return await self._call("POST", f"{RESOURCE_API}/resourceslices", obj)

    async def update_resource_slice(self, obj: Dict[str, Any]) -> Dict[str, Any]:
        name = obj["metadata"]["name"]
        return await self._call("PUT", f"{RESOURCE_API}/resourceslices/{name}", obj)

    async def delete_resource_slice(self, name: str,
                                    resource_version: Optional[str] = None) -> None:
        options: Dict[str, Any] = {"kind": "DeleteOptions", "apiVersion": "v1"}
        if resource_version:
            options["preconditions"] = {"resourceVersion": resource_version}
        await self._call("DELETE", f"{RESOURCE_API}/resourceslices/{name}", options)
