"""An API-server stand-in over real HTTP for the endpoints the host uses, and the real one.

``ApiServerStandIn`` serves, on 127.0.0.1 from its own thread (so sync and async tests can use
it alike), what kube-apiserver serves for: ResourceSlice create / update / delete / get / list
(field selectors spec.nodeName, spec.driver and metadata.name, as upstream's
addConversionFuncs in pkg/apis/resource/v1 allows; any other label is a 400), ResourceClaim
get, Pod get (``put_pod``), Node get, list and watch (field selector metadata.name only).
Like the real server it
  * validates slices with upstream's rules (host/sim/resource_validation.py) and answers
    422 with a Status whose details.causes name the fields;
  * keeps one resourceVersion counter (etcd's revision) and answers 409 Conflict to an update
    whose resourceVersion is stale and to a delete whose precondition fails; an update without
    resourceVersion is unconditional (the ResourceSlice strategy allows it); an update of a
    missing object is 404 (AllowCreateOnUpdate is false); create with a resourceVersion is 400;
    a create of an existing name is 409 AlreadyExists; generateName gets 5 random characters;
  * drops ``devices[].taints`` while the DRADeviceTaints gate is off, as 1.34 and 1.35 do by
    default (dropDisabledFields), unless ``device_taints=True`` (1.36 default); drops
    ``allowMultipleAllocations`` and every capacity's ``requestPolicy`` with
    ``consumable_capacity=False`` (DRAConsumableCapacity off: 1.33, 1.34 by default, or
    turned off), and ``sharedCounters`` / ``consumesCounters`` with
    ``partitionable_devices=False``, each unless the old object used them;
  * goes away on ``stop()``: the listening socket closes (connections refused) and open
    keep-alive connections are cut, as when the process dies; ``start()`` comes back on the
    same port.
  * answers 401 without one of ``tokens`` as bearer token, and serves HTTPS with ``tls=True``
    (a self-signed certificate for 127.0.0.1; ``write_service_account`` lays out the token
    and CA as the kubelet mounts them, for the in-cluster path);
  * sends Retry-After: 1 with a 429, as API Priority and Fairness does;
  * streams ResourceSlice watches (``?watch=true``, chunked JSON lines of {"type", "object"},
    field selectors as for lists): from ``resourceVersion`` on, or the current objects as
    ADDED first without one; an ERROR event 410 Expired for a resourceVersion older than the
    last ``compact()``, and on an open watch that had not sent every event ``compact()``
    removed (the real server never skips an event: it ends a watch that fell behind, and the
    client's resumption from there is too old); a DeleteCollection
    (``delete_slices_of_node``) is one DELETED event per slice. Watches are counted in
    ``watches``, not in ``requests``/``request_log``;
    ``end_watches()`` ends every open one, as its timeoutSeconds does;
  * answers after its watches: a request's state is read (or written) first, and its answer
    is held until every open watch has sent the events up to the newest revision, so a client
    sees a deletion on its watch before the LIST answer that still holds the slice, as
    client-go may over two connections (``events_before_answers``, on by default);
    ``before_answer`` (a test's hook, may be async) runs between reading and answering, where
    the kubelet's wipe can land while a LIST is in flight; ``answer_jitter_s`` delays each
    answer by a random time up to that after its state was read;
  * sets ``taints[].timeAdded`` to the time of the write where a kept taint has none, as the
    v1 defaulting (SetDefaults_DeviceTaint) does.
  * has Nodes made and deleted by the test (``add_node``, ``delete_node``: ADDED / DELETED
    events for Node watches); a deleted Node's ResourceSlices stay, as they do with
    kube-apiserver alone: only kube-controller-manager's garbage collector removes objects
    whose owner is gone, and it is not part of either server (``collect_garbage`` does what
    it would, for a test that wants it).
Failure injection (``fail_next``) answers the next N matching requests with a given status,
with the Status body the real server would send.

``RealApiServer`` runs etcd and kube-apiserver from ``KUBEBUILDER_ASSETS`` (the envtest
convention) with the same helper methods (``SHARED_HELPERS``); the ``kube_api`` fixture starts
it once per process and empties it for each test.

Its validation rules are in resource_validation.py.
"""

from __future__ import annotations

import asyncio
import atexit
import copy
import inspect
import json
import os
import random
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable, Dict, Iterator, List, Optional, Set, Tuple
from urllib.parse import parse_qs, unquote, urlsplit

from host.sim.resource_validation import (
    DecodeError,
    FieldError,
    canonicalize_quantities,
    resource_slice_errors,
)

GROUP = "resource.k8s.io"
RESOURCE_PREFIX = "/apis/resource.k8s.io/v1"
SLICE_FIELDS = ("metadata.name", "spec.nodeName", "spec.driver")
_GENERATE_CHARS = "bcdfghjklmnpqrstvwxz2456789"  # apimachinery's SimpleNameGenerator alphabet


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def status_body(code: int, reason: str, message: str,
                details: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """metav1.Status exactly as apiserver's responsewriters write it."""
    body: Dict[str, Any] = {"kind": "Status", "apiVersion": "v1", "metadata": {},
                            "status": "Failure", "message": message, "reason": reason,
                            "code": code}
    if details is not None:
        body["details"] = details
    return body


def _not_found(resource: str, name: str) -> Tuple[int, Dict[str, Any]]:
    group = "" if resource == "nodes" else GROUP
    qualified = f"{resource}.{group}" if group else resource
    return 404, status_body(404, "NotFound", f'{qualified} "{name}" not found',
                            {"name": name, "group": group, "kind": resource} if group
                            else {"name": name, "kind": resource})


def _conflict(name: str, message: Optional[str] = None) -> Tuple[int, Dict[str, Any]]:
    text = message or (f'Operation cannot be fulfilled on resourceslices.{GROUP} "{name}": '
                       "the object has been modified; please apply your changes to the latest "
                       "version and try again")
    return 409, status_body(409, "Conflict", text,
                            {"name": name, "group": GROUP, "kind": "resourceslices"})


def _invalid(name: str, errors: List[FieldError]) -> Tuple[int, Dict[str, Any]]:
    texts = [str(e) for e in errors]
    joined = texts[0] if len(texts) == 1 else "[" + ", ".join(texts) + "]"
    message = f'ResourceSlice.{GROUP} "{name}" is invalid: {joined}'
    causes = [{"reason": e.kind, "message": e.body(), "field": e.field} for e in errors]
    return 422, status_body(422, "Invalid", message,
                            {"name": name, "group": GROUP, "kind": "ResourceSlice",
                             "causes": causes})


def _bad_request(message: str) -> Tuple[int, Dict[str, Any]]:
    return 400, status_body(400, "BadRequest", message)


_REASONS = {400: "BadRequest", 401: "Unauthorized", 403: "Forbidden", 404: "NotFound",
            409: "Conflict", 422: "Invalid", 429: "TooManyRequests",
            500: "InternalError", 503: "ServiceUnavailable", 504: "Timeout"}


@dataclass
class _Failure:
    status: int
    remaining: int
    verbs: Optional[Set[str]]
    message: str
    reason: str


@dataclass(frozen=True)
class _Event:
    """One watch event as the watch cache keeps it: serialized once, as the apiserver's
    cacher keeps an event's encoding, so the history holds no object graph (a deep copy per
    event made every full garbage collection of the process walk the whole history, a pause
    that grew with every write and landed on whatever a benchmark was timing)."""

    revision: int
    kind: str  # the object's kind: "ResourceSlice" or "Node"
    fields: Tuple[Tuple[str, str], ...]  # the field-selector values of the object
    line: bytes  # {"type", "object"} as one JSON line, the watch's chunk payload

    def field(self, name: str) -> str:
        return dict(self.fields).get(name, "")


@dataclass
class _State:
    slices: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    nodes: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    claims: Dict[Tuple[str, str], Dict[str, Any]] = field(default_factory=dict)
    pods: Dict[Tuple[str, str], Dict[str, Any]] = field(default_factory=dict)
    revision: int = 1
    # The watch cache's history of events, oldest first (revisions ascending).
    events: List[_Event] = field(default_factory=list)
    compacted: int = 0  # a watch from an older resourceVersion gets 410 Expired
    dropped: int = 0  # the newest event compact() removed: a watch that has not sent it ends


def _first_after(events: List[_Event], revision: int) -> int:
    """The index of the first event newer than ``revision`` in ``events`` (ascending)."""
    low, high = 0, len(events)
    while low < high:
        middle = (low + high) // 2
        if events[middle].revision <= revision:
            low = middle + 1
        else:
            high = middle
    return low


def parse_field_selector(text: str) -> List[Tuple[str, str, bool]]:
    """fields.ParseSelector: "a=b,c!=d" (also "=="); returns (field, value, equal)."""
    terms = []
    for part in [p for p in text.split(",") if p]:
        if "!=" in part:
            key, value = part.split("!=", 1)
            terms.append((key.strip(), value.strip(), False))
        elif "==" in part:
            key, value = part.split("==", 1)
            terms.append((key.strip(), value.strip(), True))
        elif "=" in part:
            key, value = part.split("=", 1)
            terms.append((key.strip(), value.strip(), True))
        else:
            raise ValueError(f"invalid selector: '{text}'; can't understand '{part}'")
    return terms


def _slice_field(obj: Dict[str, Any], name: str) -> str:
    if name == "metadata.name":
        return obj["metadata"]["name"]
    if name == "spec.nodeName":
        return obj.get("spec", {}).get("nodeName") or ""
    return obj.get("spec", {}).get("driver") or ""


class ApiServerStandIn:
    """See the module docstring. All helper methods are thread-safe and synchronous."""

    TOKEN = "standin-token"

    def __init__(self, device_taints: bool = False, latency_s: float = 0.0,
                 tls: bool = False, events_before_answers: bool = True,
                 answer_jitter_s: float = 0.0, seed: Optional[int] = None,
                 partitionable_devices: bool = True, consumable_capacity: bool = True) -> None:
        self.device_taints = device_taints
        self.partitionable_devices = partitionable_devices
        self.consumable_capacity = consumable_capacity
        self.latency_s = latency_s
        self.events_before_answers = events_before_answers
        self.answer_jitter_s = answer_jitter_s
        self._random = random.Random(seed)
        # Called on the server's loop with (verb, path) after a request's state was read or
        # written and before its answer is sent; may return an awaitable, which is awaited.
        self.before_answer: Optional[Callable[[str, str], Any]] = None
        self.tls = tls
        # Bearer tokens the server accepts (401 otherwise); a test rotates by replacing it.
        self.tokens: Set[str] = {self.TOKEN}
        self._ssl: Optional[ssl.SSLContext] = None
        self.host = "127.0.0.1"
        self.port = 0
        self.requests: Counter = Counter()  # by verb: create/update/delete/list/get
        self.request_log: List[Tuple[str, str, int]] = []  # (method, path, status)
        self._lock = threading.Lock()
        self._state = _State()
        self._failures: List[_Failure] = []
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._thread: Optional[threading.Thread] = None
        self._server: Optional[asyncio.AbstractServer] = None
        self._writers: Set[asyncio.StreamWriter] = set()
        self._serving: Set[asyncio.Task] = set()  # one per open connection
        self._tmpdir = tempfile.mkdtemp(prefix="dph-apiserver-")
        self.kubeconfig_path = os.path.join(self._tmpdir, "kubeconfig")
        self.ca_path = os.path.join(self._tmpdir, "ca.crt")
        self._changed = threading.Condition(self._lock)
        self._writes = 0
        self._watch_wakers: Set[asyncio.Event] = set()  # one per open watch, on self._loop
        # The revision each open watch has sent its events up to (keyed by its waker).
        self._watch_sent: Dict[asyncio.Event, int] = {}
        self._watch_progress: Optional[asyncio.Event] = None
        self._watch_enders: Set[asyncio.Event] = set()
        self.watches = 0  # watch requests served (kept out of ``requests``/``request_log``)
        # Called from the server's thread after each successful write with (verb, object):
        # lets a benchmark timestamp the moment the server holds a change.
        self.on_write: Optional[Callable[[str, Dict[str, Any]], None]] = None

    # -- life cycle ---------------------------------------------------------------------------

    def __enter__(self) -> ApiServerStandIn:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.host}:{self.port}"

    def write_service_account(self, directory: str, token: Optional[str] = None) -> None:
        """What the kubelet mounts at /var/run/secrets/kubernetes.io/serviceaccount."""
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, "token"), "w", encoding="utf-8") as handle:
            handle.write(token or self.TOKEN)
        if self.tls:
            shutil.copyfile(self.ca_path, os.path.join(directory, "ca.crt"))

    def _make_certificate(self) -> ssl.SSLContext:
        """A self-signed serving certificate for 127.0.0.1 (the openssl CLI)."""
        key = os.path.join(self._tmpdir, "tls.key")
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes",
                        "-keyout", key, "-out", self.ca_path, "-days", "2",
                        "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                       check=True, capture_output=True)
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(self.ca_path, key)
        return ctx

    @property
    def running(self) -> bool:
        return self._server is not None

    def start(self) -> None:
        """Serve (again, on the same port after ``stop``)."""
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            ready = threading.Event()

            def loop_main() -> None:
                assert self._loop is not None
                asyncio.set_event_loop(self._loop)
                self._loop.call_soon(ready.set)
                self._loop.run_forever()

            self._thread = threading.Thread(target=loop_main, name="apiserver-standin",
                                            daemon=True)
            self._thread.start()
            ready.wait()
        if self._server is None:
            self._submit(self._listen())
            self._write_kubeconfig()

    def stop(self) -> None:
        """An outage: the port refuses connections and open connections are cut."""
        if self._server is not None:
            self._submit(self._shutdown())

    def close(self) -> None:
        self.stop()
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            if self._thread is not None:
                self._thread.join(5)
            self._loop.close()
            self._loop = None
        shutil.rmtree(self._tmpdir, ignore_errors=True)

    def _submit(self, coro: Any) -> Any:
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

    async def _listen(self) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        self.port = sock.getsockname()[1]
        if self.tls and self._ssl is None:
            self._ssl = self._make_certificate()
        if self._watch_progress is None:
            self._watch_progress = asyncio.Event()
        self._server = await asyncio.start_server(self._serve, sock=sock, ssl=self._ssl)

    async def _shutdown(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()
        for writer in list(self._writers):
            transport = writer.transport
            transport.abort()  # a dead process: RST, no graceful close
        self._writers.clear()
        if self._serving:  # let each connection's task see its end before the loop stops
            await asyncio.wait(set(self._serving), timeout=2)
        if server is not None:
            await server.wait_closed()

    def _write_kubeconfig(self) -> None:
        config = {
            "apiVersion": "v1", "kind": "Config", "current-context": "standin",
            "clusters": [{"name": "standin", "cluster": dict(
                {"server": self.url}, **({"certificate-authority": self.ca_path}
                                         if self.tls else {}))}],
            "contexts": [{"name": "standin", "context": {"cluster": "standin",
                                                         "user": "standin"}}],
            "users": [{"name": "standin", "user": {"token": self.TOKEN}}],
        }
        with open(self.kubeconfig_path, "w", encoding="utf-8") as handle:
            json.dump(config, handle)  # JSON is YAML

    # -- helpers for tests --------------------------------------------------------------------

    def add_node(self, name: str) -> Dict[str, Any]:
        """Register the Node (as the kubelet does); an existing one is returned as it is."""
        with self._lock:
            if name in self._state.nodes:
                return copy.deepcopy(self._state.nodes[name])
            node = {"apiVersion": "v1", "kind": "Node",
                    "metadata": {"name": name, "uid": str(uuid.uuid4()),
                                 "resourceVersion": self._bump(),
                                 "creationTimestamp": _now()},
                    "spec": {}, "status": {}}
            self._state.nodes[name] = node
            self._event("ADDED", node)
            self._notify()
            return copy.deepcopy(node)

    def delete_node(self, name: str) -> bool:
        """``kubectl delete node``: the Node goes (no finalizers); its slices stay."""
        return self._delete_from(self._state.nodes, name)

    def set_node_status(self, name: str, capacity: Dict[str, str],
                        allocatable: Dict[str, str]) -> Dict[str, Any]:
        """What the kubelet's node status sync writes (a merge patch of ``status``): these
        keys of ``status.capacity`` and ``status.allocatable`` set, others kept; a MODIFIED
        event for Node watches."""
        with self._lock:
            node = self._state.nodes.get(name)
            if node is None:
                raise KeyError(f"no Node {name}")
            status = node.setdefault("status", {})
            status.setdefault("capacity", {}).update(capacity)
            status.setdefault("allocatable", {}).update(allocatable)
            node["metadata"]["resourceVersion"] = self._bump()
            self._event("MODIFIED", node)
            self._notify()
            return copy.deepcopy(node)

    def collect_garbage(self) -> int:
        """What the garbage collector does: delete every ResourceSlice whose Node owner (by
        uid) no longer exists; the number deleted."""
        with self._lock:
            alive = {n["metadata"]["uid"] for n in self._state.nodes.values()}
            names = [n for n, s in self._state.slices.items()
                     if any(o.get("kind") == "Node" and o.get("uid") not in alive
                            for o in (s["metadata"].get("ownerReferences") or []))]
            for name in names:
                old = self._state.slices.pop(name)
                self._bump()
                self._event("DELETED", old)
            if names:
                self._notify()
            return len(names)

    def put_resource_claim(self, obj: Dict[str, Any]) -> Dict[str, Any]:
        claim = copy.deepcopy(obj)
        meta = claim.setdefault("metadata", {})
        meta.setdefault("namespace", "default")
        meta.setdefault("uid", str(uuid.uuid4()))
        claim.setdefault("apiVersion", f"{GROUP}/v1")
        claim.setdefault("kind", "ResourceClaim")
        with self._lock:
            meta["resourceVersion"] = self._bump()
            self._state.claims[(meta["namespace"], meta["name"])] = claim
            return copy.deepcopy(claim)

    def delete_resource_claim(self, namespace: str, name: str) -> None:
        with self._lock:
            self._state.claims.pop((namespace, name), None)

    def put_pod(self, obj: Dict[str, Any]) -> Dict[str, Any]:
        """Create (or replace) a Pod with its status as given; the stored Pod is returned."""
        pod = copy.deepcopy(obj)
        meta = pod.setdefault("metadata", {})
        meta.setdefault("namespace", "default")
        meta.setdefault("uid", str(uuid.uuid4()))
        pod.setdefault("apiVersion", "v1")
        pod.setdefault("kind", "Pod")
        with self._lock:
            meta["resourceVersion"] = self._bump()
            self._state.pods[(meta["namespace"], meta["name"])] = pod
            return copy.deepcopy(pod)

    def resource_slices(self, driver: Optional[str] = None,
                        node: Optional[str] = None) -> List[Dict[str, Any]]:
        with self._lock:
            return [copy.deepcopy(s) for s in self._state.slices.values()
                    if (driver is None or s["spec"].get("driver") == driver)
                    and (node is None or s["spec"].get("nodeName") == node)]

    def devices(self, driver: Optional[str] = None,
                node: Optional[str] = None) -> Dict[str, Dict[str, Any]]:
        """Every published device by name, across the slices of the newest pool generation."""
        slices = self.resource_slices(driver, node)
        newest: Dict[Tuple[str, str], int] = {}
        for s in slices:
            key = (s["spec"]["driver"], s["spec"]["pool"]["name"])
            newest[key] = max(newest.get(key, 0), s["spec"]["pool"]["generation"])
        out = {}
        for s in slices:
            key = (s["spec"]["driver"], s["spec"]["pool"]["name"])
            if s["spec"]["pool"]["generation"] == newest[key]:
                for d in s["spec"].get("devices") or []:
                    out[d["name"]] = d
        return out

    def delete_slices_of_node(self, node: str) -> int:
        """What every kubelet start does (DeleteCollection by spec.nodeName)."""
        with self._lock:
            names = [n for n, s in self._state.slices.items()
                     if s["spec"].get("nodeName") == node]
            for name in names:  # DeleteCollection deletes one by one: one revision each
                old = self._state.slices.pop(name)
                self._bump()
                self._event("DELETED", old)
            if names:
                self._notify()
            return len(names)

    def delete_slice(self, name: str) -> bool:
        """Delete one slice as another client would (its DELETED event included)."""
        return self._delete_from(self._state.slices, name)

    def _delete_from(self, table: Dict[str, Dict[str, Any]], name: str) -> bool:
        """Remove ``name`` from ``table`` with its DELETED event; False if it was not there."""
        with self._lock:
            old = table.pop(name, None)
            if old is None:
                return False
            self._bump()
            self._event("DELETED", old)
            self._notify()
            return True

    def put_resource_slice(self, obj: Dict[str, Any]) -> Dict[str, Any]:
        """Write a slice as another client would (no validation): for conflict tests."""
        with self._lock:
            stored = copy.deepcopy(obj)
            meta = stored.setdefault("metadata", {})
            meta.setdefault("uid", str(uuid.uuid4()))
            meta.setdefault("creationTimestamp", _now())
            meta["resourceVersion"] = self._bump()
            kind = "MODIFIED" if meta["name"] in self._state.slices else "ADDED"
            self._state.slices[meta["name"]] = stored
            self._event(kind, stored)
            self._notify()
            return copy.deepcopy(stored)

    def fail_next(self, status: int, count: int = 1, verbs: Optional[Set[str]] = None,
                  message: str = "injected failure", reason: Optional[str] = None) -> None:
        """Answer the next ``count`` requests (of ``verbs``, default all) with ``status``."""
        with self._lock:
            self._failures.append(_Failure(status, count, set(verbs) if verbs else None,
                                           message, reason or _REASONS.get(status, "Unknown")))

    def reset_counters(self) -> None:
        with self._lock:
            self.requests.clear()
            self.request_log.clear()

    def wait_for(self, predicate: Any, timeout: float = 5.0) -> bool:
        """Block until ``predicate(self)`` holds after a write, or the deadline passes."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                seen = self._writes
            if predicate(self):
                return True
            with self._changed:
                while self._writes == seen:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        return False
                    self._changed.wait(remaining)

    # -- HTTP ---------------------------------------------------------------------------------

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        task = asyncio.current_task()
        if task is not None:
            self._serving.add(task)
            task.add_done_callback(self._serving.discard)
        try:
            while True:
                line = await reader.readline()
                if not line:
                    return
                try:
                    method, target, _version = line.decode("latin-1").split(" ", 2)
                except ValueError:
                    return
                headers: Dict[str, str] = {}
                while True:
                    raw = await reader.readline()
                    if raw in (b"\r\n", b"\n", b""):
                        break
                    key, _, value = raw.decode("latin-1").partition(":")
                    headers[key.strip().lower()] = value.strip()
                length = int(headers.get("content-length") or 0)
                body = await reader.readexactly(length) if length else b""
                if self.latency_s:
                    await asyncio.sleep(self.latency_s)
                if self._is_watch(method, target):
                    await self._serve_watch(target, headers.get("authorization", ""), reader,
                                            writer)
                    return  # the real server ends a watch by closing its response
                status, payload = self._handle(method, target, body,
                                               headers.get("authorization", ""))
                await self._before_answer(method, target)
                data = json.dumps(payload, separators=(",", ":")).encode()
                # API Priority and Fairness answers 429 with Retry-After: 1.
                extra = "Retry-After: 1\r\n" if status == 429 else ""
                writer.write(
                    f"HTTP/1.1 {status} {_REASONS.get(status, 'OK') if status >= 400 else 'OK'}"
                    f"\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n"
                    f"Audit-Id: {uuid.uuid4()}\r\n{extra}\r\n".encode("latin-1") + data)
                await writer.drain()
                if headers.get("connection", "").lower() == "close":
                    return
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            self._writers.discard(writer)
            try:
                writer.close()
            except RuntimeError:
                pass

    async def _before_answer(self, method: str, target: str) -> None:
        """Between reading a request's state and answering it (see the module docstring)."""
        if self.answer_jitter_s > 0:
            await asyncio.sleep(self._random.uniform(0, self.answer_jitter_s))
        hook = self.before_answer
        if hook is not None:
            path = unquote(urlsplit(target).path).rstrip("/")
            result = hook(self._route(method, path)[0], path)
            if inspect.isawaitable(result):
                await result
        if self.events_before_answers:
            # The newest event, not the newest revision: writes no watch reports (claims,
            # Nodes made without a watcher) bump the revision too, and no watch ever "sends"
            # up to them.
            with self._lock:
                events = self._state.events
                revision = events[-1].revision if events else 0
            await self._watches_reached(revision)

    async def _watches_reached(self, revision: int, timeout_s: float = 0.25) -> None:
        """Wait until every open watch has sent its events up to ``revision`` (bounded: a
        client that stopped reading its watch must not stall every answer)."""
        progress = self._watch_progress
        if progress is None:
            return
        deadline = time.monotonic() + timeout_s
        while any(sent < revision for sent in self._watch_sent.values()):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            progress.clear()
            try:
                await asyncio.wait_for(progress.wait(), remaining)
            except asyncio.TimeoutError:
                return

    def end_watches(self) -> None:
        """End every open watch (what its timeoutSeconds does): the client resumes from the
        last resourceVersion it saw, and gets 410 Expired after ``compact()``."""
        loop = self._loop
        if loop is None:
            return

        def end() -> None:
            for ender in list(self._watch_enders):
                ender.set()

        loop.call_soon_threadsafe(end)

    def _handle(self, method: str, target: str, body: bytes,
                authorization: str = "") -> Tuple[int, Any]:
        parts = urlsplit(target)
        path = unquote(parts.path).rstrip("/")
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        verb, handler, args = self._route(method, path)
        token = authorization[7:] if authorization.startswith("Bearer ") else None
        with self._lock:
            self.requests[verb] += 1
            failure = self._take_failure(verb)
            if token not in self.tokens:
                result = 401, status_body(401, "Unauthorized", "Unauthorized")
            elif failure is not None:
                result = failure.status, status_body(failure.status, failure.reason,
                                                     failure.message)
            elif handler is None:
                result = 404, status_body(404, "NotFound", "the server could not find the "
                                          "requested resource")
            else:
                try:
                    obj = json.loads(body) if body else None
                except ValueError as err:
                    result = _bad_request(f"the body of the request was in an unknown format: "
                                          f"{err}")
                else:
                    try:
                        result = handler(*args, obj=obj, query=query)
                    except DecodeError as err:
                        result = _bad_request(f"ResourceSlice in version \"v1\" cannot be "
                                              f"handled as a ResourceSlice: {err}")
            self.request_log.append((method, path, result[0]))
            wrote = result[0] < 300 and verb in ("create", "update", "delete")
            if wrote:
                self._notify()
        hook = self.on_write
        if wrote and hook is not None:
            hook(verb, result[1])
        return result

    def _take_failure(self, verb: str) -> Optional[_Failure]:
        for failure in self._failures:
            if failure.remaining > 0 and (failure.verbs is None or verb in failure.verbs):
                failure.remaining -= 1
                if failure.remaining == 0:
                    self._failures.remove(failure)
                return failure
        return None

    def _route(self, method: str, path: str) -> Tuple[str, Any, Tuple[str, ...]]:
        segs = path.strip("/").split("/")
        if method == "GET" and len(segs) == 4 and segs[:3] == ["api", "v1", "nodes"]:
            return "get", self._get_node, (segs[3],)
        if method == "GET" and segs == ["api", "v1", "nodes"]:
            return "list", self._list_nodes, ()
        if method == "GET" and len(segs) == 6 and segs[:3] == ["api", "v1", "namespaces"] \
                and segs[4] == "pods":
            return "get", self._get_pod, (segs[3], segs[5])
        if path.startswith(RESOURCE_PREFIX):
            rest = segs[3:]
            if len(rest) == 4 and rest[0] == "namespaces" and rest[2] == "resourceclaims" \
                    and method == "GET":
                return "get", self._get_claim, (rest[1], rest[3])
            if rest == ["resourceslices"]:
                if method == "GET":
                    return "list", self._list_slices, ()
                if method == "POST":
                    return "create", self._create_slice, ()
            if len(rest) == 2 and rest[0] == "resourceslices":
                if method == "GET":
                    return "get", self._get_slice, (rest[1],)
                if method == "PUT":
                    return "update", self._update_slice, (rest[1],)
                if method == "DELETE":
                    return "delete", self._delete_slice, (rest[1],)
        return method.lower(), None, ()

    def _notify(self) -> None:
        self._writes += 1
        self._changed.notify_all()

    def _bump(self) -> str:
        self._state.revision += 1
        return str(self._state.revision)

    def _event(self, kind: str, obj: Dict[str, Any]) -> None:
        """Record a ResourceSlice event at the current revision and wake open watches (a
        deleted object carries the revision of its deletion, as etcd's watch reports it)."""
        item = dict(obj)
        item["metadata"] = dict(obj.get("metadata") or {},
                                resourceVersion=str(self._state.revision))
        line = json.dumps({"type": kind, "object": item}, separators=(",", ":")) + "\n"
        self._state.events.append(_Event(
            self._state.revision, str(item.get("kind", "ResourceSlice")),
            tuple((name, _slice_field(item, name)) for name in SLICE_FIELDS),
            line.encode()))
        loop = self._loop
        if loop is not None and self._watch_wakers:
            loop.call_soon_threadsafe(self._wake_watchers)

    def _wake_watchers(self) -> None:
        for waker in list(self._watch_wakers):
            waker.set()

    def compact(self) -> None:
        """What etcd compaction does to the watch cache: a watch from a resourceVersion
        before now is answered with an ERROR event, 410 Expired."""
        with self._lock:
            self._state.compacted = self._state.revision
            if self._state.events:
                self._state.dropped = max(self._state.dropped,
                                          self._state.events[-1].revision)
            self._state.events.clear()

    # -- watch --------------------------------------------------------------------------------

    @staticmethod
    def _is_watch(method: str, target: str) -> bool:
        parts = urlsplit(target)
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        return method == "GET" and unquote(parts.path).rstrip("/") in (
            f"{RESOURCE_PREFIX}/resourceslices", "/api/v1/nodes") and \
            query.get("watch") in ("1", "true")

    async def _serve_watch(self, target: str, authorization: str,
                           reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A ResourceSlice watch as the real server streams it: chunked JSON lines of
        {"type", "object"}; from ``resourceVersion`` (events after it) or, without one, the
        matching objects as ADDED first; ended by the server after ``timeoutSeconds``."""
        query = {k: v[-1] for k, v in parse_qs(urlsplit(target).query).items()}
        token = authorization[7:] if authorization.startswith("Bearer ") else None
        nodes = unquote(urlsplit(target).path).rstrip("/") == "/api/v1/nodes"
        kind_watched = "Node" if nodes else "ResourceSlice"
        fields = ("metadata.name",) if nodes else SLICE_FIELDS
        with self._lock:
            self.watches += 1
            failure = self._take_failure("watch")
            error: Optional[Tuple[int, Any]] = None
            terms: List[Tuple[str, str, bool]] = []
            if token not in self.tokens:
                error = 401, status_body(401, "Unauthorized", "Unauthorized")
            elif failure is not None:
                error = failure.status, status_body(failure.status, failure.reason,
                                                    failure.message)
            else:
                try:
                    terms = parse_field_selector(query.get("fieldSelector", ""))
                except ValueError as err:
                    error = _bad_request(str(err))
                for name, _value, _equal in terms:
                    if error is None and name not in fields:
                        error = _bad_request(f'field label not supported for '
                                             f'{"" if nodes else GROUP}/v1, '
                                             f'Kind={kind_watched}: {name}')
        if error is not None:
            data = json.dumps(error[1], separators=(",", ":")).encode()
            writer.write(f"HTTP/1.1 {error[0]} {_REASONS.get(error[0], 'Error')}\r\n"
                         f"Content-Type: application/json\r\nContent-Length: {len(data)}"
                         "\r\n\r\n".encode("latin-1") + data)
            await writer.drain()
            return

        def matches(obj: Dict[str, Any]) -> bool:
            return obj.get("kind", "ResourceSlice") == kind_watched and all(
                (_slice_field(obj, n) == v) == eq for n, v, eq in terms)

        def event_matches(event: _Event) -> bool:
            return event.kind == kind_watched and all(
                (event.field(n) == v) == eq for n, v, eq in terms)

        def framed(raw: bytes) -> bytes:
            return f"{len(raw):x}\r\n".encode() + raw + b"\r\n"

        def chunk(kind: str, obj: Dict[str, Any]) -> bytes:
            line = json.dumps({"type": kind, "object": obj}, separators=(",", ":")) + "\n"
            return framed(line.encode())

        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        waker = asyncio.Event()
        ender = asyncio.Event()
        self._watch_wakers.add(waker)
        self._watch_enders.add(ender)
        gone = asyncio.ensure_future(reader.read())  # the client closed (or was cut off)
        deadline = time.monotonic() + float(query.get("timeoutSeconds") or 1800)
        try:
            with self._lock:
                since = query.get("resourceVersion") or ""
                if since in ("", "0"):
                    current = self._state.nodes if nodes else self._state.slices
                    for obj in current.values():
                        if matches(obj):
                            writer.write(chunk("ADDED", obj))
                    seen = self._state.revision
                elif int(since) < self._state.compacted:
                    expired = status_body(410, "Expired", f"too old resource version: {since} "
                                          f"({self._state.compacted})")
                    writer.write(chunk("ERROR", expired))
                    seen = -1
                else:
                    seen = int(since)
            while seen >= 0:
                await writer.drain()
                self._watch_sent[waker] = seen
                if self._watch_progress is not None:
                    self._watch_progress.set()
                waker.clear()
                with self._lock:
                    events = self._state.events
                    first = _first_after(events, seen)
                    fresh = events[first:]
                    behind = seen < self._state.dropped
                if behind:  # events it never sent are gone: 410, as for a resumption
                    writer.write(chunk("ERROR", status_body(
                        410, "Expired", f"too old resource version: {seen} "
                        f"({self._state.compacted})")))
                    break
                for event in fresh:
                    seen = event.revision
                    if event_matches(event):
                        writer.write(framed(event.line))
                if fresh:
                    continue
                remaining = deadline - time.monotonic()
                if remaining <= 0 or gone.done() or ender.is_set():
                    break
                woken = asyncio.ensure_future(waker.wait())
                ended = asyncio.ensure_future(ender.wait())
                await asyncio.wait({woken, gone, ended}, timeout=remaining,
                                   return_when=asyncio.FIRST_COMPLETED)
                woken.cancel()
                ended.cancel()
            if not gone.done():
                writer.write(b"0\r\n\r\n")
                await writer.drain()
        finally:
            self._watch_wakers.discard(waker)
            self._watch_enders.discard(ender)
            self._watch_sent.pop(waker, None)
            if self._watch_progress is not None:
                self._watch_progress.set()
            gone.cancel()
            if gone.done() and not gone.cancelled():
                gone.exception()  # a reset connection: retrieved, not reported as lost

    # -- handlers (called with the lock held) -------------------------------------------------

    def _get_node(self, name: str, obj: Any, query: Dict[str, str]) -> Tuple[int, Any]:
        node = self._state.nodes.get(name)
        return (200, copy.deepcopy(node)) if node else _not_found("nodes", name)

    def _list_nodes(self, obj: Any, query: Dict[str, str]) -> Tuple[int, Any]:
        try:
            terms = parse_field_selector(query.get("fieldSelector", ""))
        except ValueError as err:
            return _bad_request(str(err))
        for name, _value, _equal in terms:
            if name != "metadata.name":
                return _bad_request(f'field label not supported for /v1, Kind=Node: {name}')
        items = [copy.deepcopy(n) for _, n in sorted(self._state.nodes.items())
                 if all((n["metadata"]["name"] == v) == eq for _, v, eq in terms)]
        return 200, {"kind": "NodeList", "apiVersion": "v1",
                     "metadata": {"resourceVersion": str(self._state.revision)},
                     "items": items}

    def _get_claim(self, namespace: str, name: str, obj: Any,
                   query: Dict[str, str]) -> Tuple[int, Any]:
        claim = self._state.claims.get((namespace, name))
        return (200, copy.deepcopy(claim)) if claim else _not_found("resourceclaims", name)

    def _get_pod(self, namespace: str, name: str, obj: Any,
                 query: Dict[str, str]) -> Tuple[int, Any]:
        pod = self._state.pods.get((namespace, name))
        return (200, copy.deepcopy(pod)) if pod else _not_found("pods", name)

    def _get_slice(self, name: str, obj: Any, query: Dict[str, str]) -> Tuple[int, Any]:
        stored = self._state.slices.get(name)
        return (200, copy.deepcopy(stored)) if stored else _not_found("resourceslices", name)

    def _list_slices(self, obj: Any, query: Dict[str, str]) -> Tuple[int, Any]:
        try:
            terms = parse_field_selector(query.get("fieldSelector", ""))
        except ValueError as err:
            return _bad_request(str(err))
        for name, _value, _equal in terms:
            if name not in SLICE_FIELDS:
                return _bad_request(f'field label not supported for {GROUP}/v1, '
                                    f'Kind=ResourceSlice: {name}')
        items = [copy.deepcopy(s) for _, s in sorted(self._state.slices.items())
                 if all((_slice_field(s, n) == v) == eq for n, v, eq in terms)]
        return 200, {"kind": "ResourceSliceList", "apiVersion": f"{GROUP}/v1",
                     "metadata": {"resourceVersion": str(self._state.revision)},
                     "items": items}

    def _drop_disabled(self, obj: Dict[str, Any], old: Optional[Dict[str, Any]]) -> None:
        """dropDisabledFields: taints go unless the gate is on or the old object had them (a
        kept taint without ``timeAdded`` gets the time of this write, as defaulting does); so
        do sharedCounters and consumesCounters without DRAPartitionableDevices."""
        old_spec = (old or {}).get("spec") or {}
        if not self.consumable_capacity and not any(
                d.get("allowMultipleAllocations") is not None or any(
                    isinstance(c, dict) and c.get("requestPolicy") is not None
                    for c in (d.get("capacity") or {}).values())
                for d in old_spec.get("devices") or [] if isinstance(d, dict)):
            for device in (obj.get("spec") or {}).get("devices") or []:
                if isinstance(device, dict):
                    device.pop("allowMultipleAllocations", None)
                    for value in (device.get("capacity") or {}).values():
                        if isinstance(value, dict):
                            value.pop("requestPolicy", None)
        if not self.partitionable_devices and not old_spec.get("sharedCounters") and not any(
                d.get("consumesCounters") for d in old_spec.get("devices") or []):
            spec = obj.get("spec") or {}
            spec.pop("sharedCounters", None)
            for device in spec.get("devices") or []:
                if isinstance(device, dict):
                    device.pop("consumesCounters", None)
        if self.device_taints or any(d.get("taints") for d in old_spec.get("devices") or []):
            for device in (obj.get("spec") or {}).get("devices") or []:
                for taint in (device.get("taints") or []) if isinstance(device, dict) else []:
                    if isinstance(taint, dict) and not taint.get("timeAdded"):
                        taint["timeAdded"] = _now()
            return
        for device in (obj.get("spec") or {}).get("devices") or []:
            if isinstance(device, dict):
                device.pop("taints", None)

    def _check_kind(self, obj: Any) -> Optional[Tuple[int, Any]]:
        if not isinstance(obj, dict):
            return _bad_request("the body of the request was in an unknown format")
        kind, version = obj.get("kind"), obj.get("apiVersion")
        if (kind and kind != "ResourceSlice") or (version and version != f"{GROUP}/v1"):
            return _bad_request(f"the API version in the data ({version}) does not match the "
                                f"expected API version ({GROUP}/v1)")
        return None

    def _create_slice(self, obj: Any, query: Dict[str, str]) -> Tuple[int, Any]:
        bad = self._check_kind(obj)
        if bad:
            return bad
        obj = copy.deepcopy(obj)
        meta = obj.setdefault("metadata", {})
        if meta.get("resourceVersion"):
            return _bad_request("resourceVersion should not be set on objects to be created")
        if not meta.get("name") and meta.get("generateName"):
            suffix = "".join(random.choice(_GENERATE_CHARS) for _ in range(5))
            # names.SimpleNameGenerator: the base is cut to 63 - 5 characters first
            meta["name"] = meta["generateName"][: 63 - 5] + suffix
        self._drop_disabled(obj, None)
        errors = resource_slice_errors(obj)
        if errors:
            return _invalid(meta.get("name") or meta.get("generateName") or "", errors)
        canonicalize_quantities(obj)  # decoded into resource.Quantity, stored canonical
        name = meta["name"]
        if name in self._state.slices:
            return 409, status_body(409, "AlreadyExists",
                                    f'resourceslices.{GROUP} "{name}" already exists',
                                    {"name": name, "group": GROUP, "kind": "resourceslices"})
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = _now()
        meta["generation"] = 1
        meta["resourceVersion"] = self._bump()
        obj["kind"], obj["apiVersion"] = "ResourceSlice", f"{GROUP}/v1"
        self._state.slices[name] = obj
        self._event("ADDED", obj)
        return 201, copy.deepcopy(obj)

    def _update_slice(self, name: str, obj: Any, query: Dict[str, str]) -> Tuple[int, Any]:
        bad = self._check_kind(obj)
        if bad:
            return bad
        obj = copy.deepcopy(obj)
        meta = obj.setdefault("metadata", {})
        if meta.get("name") != name:
            return _bad_request(f"the name of the object ({meta.get('name')}) does not match "
                                f"the name on the URL ({name})")
        old = self._state.slices.get(name)
        if old is None:
            return _not_found("resourceslices", name)
        version = meta.get("resourceVersion")
        if version and version != old["metadata"]["resourceVersion"]:
            return _conflict(name)
        self._drop_disabled(obj, old)
        errors = resource_slice_errors(obj, old)
        if errors:
            return _invalid(name, errors)
        canonicalize_quantities(obj)
        for key in ("uid", "creationTimestamp"):
            meta[key] = old["metadata"][key]
        obj["kind"], obj["apiVersion"] = "ResourceSlice", f"{GROUP}/v1"
        # Only a spec change bumps metadata.generation (PrepareForUpdate); any change, the
        # metadata's too (labels, owner references), is a write with a new resourceVersion.
        spec_changed = obj.get("spec") != old.get("spec")
        meta["generation"] = old["metadata"].get("generation", 1) + (1 if spec_changed else 0)
        meta["resourceVersion"] = old["metadata"]["resourceVersion"]
        if obj != old:
            meta["resourceVersion"] = self._bump()
            self._event("MODIFIED", obj)
        # else: a no-op update writes nothing and keeps the resourceVersion, as the real one.
        self._state.slices[name] = obj
        return 200, copy.deepcopy(obj)

    def _delete_slice(self, name: str, obj: Any, query: Dict[str, str]) -> Tuple[int, Any]:
        old = self._state.slices.get(name)
        if old is None:
            return _not_found("resourceslices", name)
        preconditions = (obj or {}).get("preconditions") or {}
        want_rv = preconditions.get("resourceVersion")
        if want_rv and want_rv != old["metadata"]["resourceVersion"]:
            return _conflict(name, "Precondition failed: ResourceVersion in precondition: "
                             f"{want_rv}, ResourceVersion in object meta: "
                             f"{old['metadata']['resourceVersion']}")
        want_uid = preconditions.get("uid")
        if want_uid and want_uid != old["metadata"]["uid"]:
            return _conflict(name, f"Precondition failed: UID in precondition: {want_uid}, "
                             f"UID in object meta: {old['metadata']['uid']}")
        del self._state.slices[name]
        self._bump()
        self._event("DELETED", old)
        return 200, copy.deepcopy(old)


# -- the real thing ---------------------------------------------------------------------------


def kubebuilder_assets() -> Optional[str]:
    """The directory named by KUBEBUILDER_ASSETS when it holds kube-apiserver and etcd."""
    path = os.environ.get("KUBEBUILDER_ASSETS", "")
    if path and all(os.access(os.path.join(path, b), os.X_OK) for b in ("kube-apiserver",
                                                                          "etcd")):
        return path
    return None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# What a test may use on the ``kube_api`` fixture, whichever server it is: both classes have
# each of these, with the same parameters. Counters, failure injection, ``compact`` and the
# service-account layout are the stand-in's own.
SHARED_HELPERS = ("url", "kubeconfig_path", "start", "stop", "close", "add_node",
                  "set_node_status", "put_resource_claim", "delete_resource_claim", "put_pod",
                  "resource_slices", "devices",
                  "delete_slices_of_node", "put_resource_slice", "wait_for", "device_taints")


class RealApiServer:
    """etcd + kube-apiserver from KUBEBUILDER_ASSETS, with the stand-in's helper methods
    (``SHARED_HELPERS``).

    Authentication is a static token in group system:masters (--token-auth-file); the
    serving certificate (for 127.0.0.1) and the service-account signing key are made with the
    ``openssl`` CLI, as envtest's own flags (--advertise-address 127.0.0.1, a service range)
    are given. ``stop()``
    stops kube-apiserver only (etcd keeps the data), as a control-plane restart does.
    Counters and failure injection exist only in the stand-in.
    """

    TOKEN = "dph-envtest-token"

    def __init__(self, assets: str, device_taints: bool = False,
                 partitionable_devices: bool = True, consumable_capacity: bool = True) -> None:
        self.assets = assets
        self.device_taints = device_taints
        self.partitionable_devices = partitionable_devices
        self.consumable_capacity = consumable_capacity
        self._dir = tempfile.mkdtemp(prefix="dph-envtest-")
        self.kubeconfig_path = os.path.join(self._dir, "kubeconfig")
        self.port = _free_port()
        self._etcd: Optional[subprocess.Popen] = None
        self._apiserver: Optional[subprocess.Popen] = None
        self._etcd_port = _free_port()
        self._etcd_peer = _free_port()
        self.requests: Counter = Counter()

    def __enter__(self) -> RealApiServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def _log(self, name: str) -> Any:
        return open(os.path.join(self._dir, f"{name}.log"), "ab")

    def start(self) -> None:
        if self._etcd is None:
            data = os.path.join(self._dir, "etcd")
            self._etcd = subprocess.Popen(
                [os.path.join(self.assets, "etcd"), "--data-dir", data,
                 "--listen-client-urls", f"http://127.0.0.1:{self._etcd_port}",
                 "--advertise-client-urls", f"http://127.0.0.1:{self._etcd_port}",
                 "--listen-peer-urls", f"http://127.0.0.1:{self._etcd_peer}",
                 "--unsafe-no-fsync"],
                stdout=self._log("etcd"), stderr=subprocess.STDOUT, start_new_session=True)
        if self._apiserver is not None:
            return
        certs = os.path.join(self._dir, "certs")
        os.makedirs(certs, exist_ok=True)
        key = os.path.join(certs, "sa.key")
        if not os.path.exists(key):
            subprocess.run(["openssl", "genrsa", "-out", key, "2048"], check=True,
                           capture_output=True)
        # Our own serving certificate: the one --cert-dir makes names the advertise address
        # and "localhost", which need not include 127.0.0.1.
        serving_key = os.path.join(certs, "serving.key")
        self.ca_path = os.path.join(certs, "serving.crt")
        if not os.path.exists(self.ca_path):
            subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes",
                            "-keyout", serving_key, "-out", self.ca_path, "-days", "2",
                            "-subj", "/CN=127.0.0.1",
                            "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
                           check=True, capture_output=True)
        tokens = os.path.join(self._dir, "tokens.csv")
        with open(tokens, "w", encoding="utf-8") as handle:
            handle.write(f'{self.TOKEN},admin,admin-uid,"system:masters"\n')
        gates = ",".join(g for g in (
            "DRADeviceTaints=true" if self.device_taints else "",
            "" if self.partitionable_devices else "DRAPartitionableDevices=false",
            "" if self.consumable_capacity else "DRAConsumableCapacity=false") if g)
        args = [os.path.join(self.assets, "kube-apiserver"),
                "--etcd-servers", f"http://127.0.0.1:{self._etcd_port}",
                "--secure-port", str(self.port), "--bind-address", "127.0.0.1",
                "--advertise-address", "127.0.0.1",
                "--tls-cert-file", self.ca_path, "--tls-private-key-file", serving_key,
                "--token-auth-file", tokens,
                "--authorization-mode", "RBAC",
                "--service-account-issuer", "https://kubernetes.default.svc",
                "--service-account-key-file", key,
                "--service-account-signing-key-file", key,
                "--service-cluster-ip-range", "10.0.0.0/24",
                "--disable-admission-plugins", "ServiceAccount"]
        if gates:
            args += ["--feature-gates", gates]
        self._apiserver = subprocess.Popen(args, stdout=self._log("kube-apiserver"),
                                           stderr=subprocess.STDOUT, start_new_session=True)
        self._write_kubeconfig(certs)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self._apiserver.poll() is not None:
                raise RuntimeError(f"kube-apiserver exited; see {self._dir}/kube-apiserver.log")
            try:
                if self._request("GET", "/readyz")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)  # a child process start-up: nothing to wait on but the port
        raise RuntimeError("kube-apiserver did not become ready in 60 s")

    def _write_kubeconfig(self, certs: str) -> None:
        config = {
            "apiVersion": "v1", "kind": "Config", "current-context": "envtest",
            "clusters": [{"name": "envtest", "cluster": {
                "server": self.url, "certificate-authority": self.ca_path}}],
            "contexts": [{"name": "envtest", "context": {"cluster": "envtest",
                                                         "user": "admin"}}],
            "users": [{"name": "admin", "user": {"token": self.TOKEN}}],
        }
        with open(self.kubeconfig_path, "w", encoding="utf-8") as handle:
            json.dump(config, handle)

    def _stop_process(self, proc: Optional[subprocess.Popen]) -> None:
        if proc is None or proc.poll() is not None:
            return
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)

    def stop(self) -> None:
        self._stop_process(self._apiserver)
        self._apiserver = None

    def close(self) -> None:
        self.stop()
        self._stop_process(self._etcd)
        self._etcd = None
        shutil.rmtree(self._dir, ignore_errors=True)

    def _request(self, method: str, path: str, body: Optional[Dict[str, Any]] = None,
                 content_type: str = "application/json") -> Tuple[int, Any]:
        import http.client

        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        conn = http.client.HTTPSConnection("127.0.0.1", self.port, context=ctx, timeout=10)
        try:
            data = json.dumps(body).encode() if body is not None else None
            conn.request(method, path, body=data, headers={
                "Authorization": f"Bearer {self.TOKEN}", "Content-Type": content_type,
                "Accept": "application/json"})
            response = conn.getresponse()
            raw = response.read()
            try:
                return response.status, json.loads(raw) if raw else None
            except ValueError:
                return response.status, raw.decode(errors="replace")
        finally:
            conn.close()

    def add_node(self, name: str) -> Dict[str, Any]:
        status, obj = self._request("POST", "/api/v1/nodes", {
            "apiVersion": "v1", "kind": "Node", "metadata": {"name": name}})
        if status == 409:
            status, obj = self._request("GET", f"/api/v1/nodes/{name}")
        if status >= 300:
            raise RuntimeError(f"add_node: {status} {obj}")
        return obj

    def set_node_status(self, name: str, capacity: Dict[str, str],
                        allocatable: Dict[str, str]) -> Dict[str, Any]:
        status, obj = self._request(
            "PATCH", f"/api/v1/nodes/{name}/status",
            {"status": {"capacity": capacity, "allocatable": allocatable}},
            content_type="application/merge-patch+json")
        if status >= 300:
            raise RuntimeError(f"set_node_status: {status} {obj}")
        return obj

    def delete_node(self, name: str) -> bool:
        status, obj = self._request("DELETE", f"/api/v1/nodes/{name}")
        if status == 404:
            return False
        if status >= 300:
            raise RuntimeError(f"delete_node: {status} {obj}")
        return True

    def collect_garbage(self) -> int:
        """The garbage collector's work (kube-controller-manager does not run here): delete
        every ResourceSlice whose Node owner no longer exists."""
        status, nodes = self._request("GET", "/api/v1/nodes")
        if status >= 300:
            raise RuntimeError(f"collect_garbage: {status} {nodes}")
        alive = {n["metadata"]["uid"] for n in nodes.get("items") or []}
        gone = 0
        for piece in self.resource_slices():
            if any(o.get("kind") == "Node" and o.get("uid") not in alive
                   for o in piece["metadata"].get("ownerReferences") or []):
                name = piece["metadata"]["name"]
                status, _ = self._request("DELETE", f"{RESOURCE_PREFIX}/resourceslices/{name}")
                if status < 300:
                    gone += 1
        return gone

    def put_resource_claim(self, obj: Dict[str, Any]) -> Dict[str, Any]:
        claim = copy.deepcopy(obj)
        meta = claim.setdefault("metadata", {})
        namespace = meta.setdefault("namespace", "default")
        claim.setdefault("apiVersion", f"{GROUP}/v1")
        claim.setdefault("kind", "ResourceClaim")
        base = f"{RESOURCE_PREFIX}/namespaces/{namespace}/resourceclaims"
        status_part = claim.pop("status", None)
        self._request("DELETE", f"{base}/{meta['name']}")
        code, created = self._request("POST", base, claim)
        if code >= 300:
            raise RuntimeError(f"put_resource_claim: {code} {created}")
        if status_part:
            created["status"] = status_part
            code, created = self._request("PUT", f"{base}/{meta['name']}/status", created)
            if code >= 300:
                raise RuntimeError(f"put_resource_claim status: {code} {created}")
        return created

    def delete_resource_claim(self, namespace: str, name: str) -> None:
        """Delete the claim; a missing one is no error, as in the stand-in. A claim with
        finalizers (the scheduler's delete-protection) stays until they are removed."""
        code, body = self._request(
            "DELETE", f"{RESOURCE_PREFIX}/namespaces/{namespace}/resourceclaims/{name}")
        if code >= 300 and code != 404:
            raise RuntimeError(f"delete_resource_claim: {code} {body}")

    def put_pod(self, obj: Dict[str, Any]) -> Dict[str, Any]:
        pod = copy.deepcopy(obj)
        meta = pod.setdefault("metadata", {})
        namespace = meta.setdefault("namespace", "default")
        pod.setdefault("apiVersion", "v1")
        pod.setdefault("kind", "Pod")
        base = f"/api/v1/namespaces/{namespace}/pods"
        status_part = pod.pop("status", None)
        self._request("DELETE", f"{base}/{meta['name']}?gracePeriodSeconds=0")
        code, created = self._request("POST", base, pod)
        if code >= 300:
            raise RuntimeError(f"put_pod: {code} {created}")
        if status_part:
            created["status"] = dict(created.get("status") or {}, **status_part)
            code, created = self._request("PUT", f"{base}/{meta['name']}/status", created)
            if code >= 300:
                raise RuntimeError(f"put_pod status: {code} {created}")
        return created

    def resource_slices(self, driver: Optional[str] = None,
                        node: Optional[str] = None) -> List[Dict[str, Any]]:
        terms = []
        if driver:
            terms.append(f"spec.driver={driver}")
        if node:
            terms.append(f"spec.nodeName={node}")
        query = f"?fieldSelector={','.join(terms)}" if terms else ""
        status, obj = self._request("GET", f"{RESOURCE_PREFIX}/resourceslices{query}")
        if status != 200:
            raise RuntimeError(f"list: {status} {obj}")
        return list(obj.get("items") or [])

    def devices(self, driver: Optional[str] = None,
                node: Optional[str] = None) -> Dict[str, Dict[str, Any]]:
        return ApiServerStandIn.devices(self, driver, node)  # type: ignore[arg-type]

    def delete_slices_of_node(self, node: str) -> int:
        count = len(self.resource_slices(node=node))
        self._request("DELETE", f"{RESOURCE_PREFIX}/resourceslices?fieldSelector="
                      f"spec.nodeName={node}")
        return count

    def put_resource_slice(self, obj: Dict[str, Any]) -> Dict[str, Any]:
        name = obj["metadata"]["name"]
        body = copy.deepcopy(obj)
        body["metadata"].pop("resourceVersion", None)
        status, stored = self._request("PUT", f"{RESOURCE_PREFIX}/resourceslices/{name}", body)
        if status == 404:
            status, stored = self._request("POST", f"{RESOURCE_PREFIX}/resourceslices", body)
        if status >= 300:
            raise RuntimeError(f"put_resource_slice: {status} {stored}")
        return stored

    def reset(self) -> None:
        """Back to an empty cluster for the next test: no ResourceSlices, Nodes or
        ResourceClaims (none of them has a finalizer without a scheduler or kubelet)."""
        if self._apiserver is None:
            self.start()
        namespaces = {c["metadata"]["namespace"] for c in self._list(
            f"{RESOURCE_PREFIX}/resourceclaims")}
        pod_namespaces = {p["metadata"]["namespace"] for p in self._list("/api/v1/pods")}
        for path in [f"{RESOURCE_PREFIX}/resourceslices", "/api/v1/nodes",
                     *(f"{RESOURCE_PREFIX}/namespaces/{ns}/resourceclaims"
                       for ns in sorted(namespaces)),
                     *(f"/api/v1/namespaces/{ns}/pods?gracePeriodSeconds=0"
                       for ns in sorted(pod_namespaces))]:
            code, body = self._request("DELETE", path)
            if code >= 300:
                raise RuntimeError(f"reset: DELETE {path}: {code} {body}")
            if self._list(path):
                raise RuntimeError(f"reset: {path} is not empty after its DeleteCollection")

    def _list(self, path: str) -> List[Dict[str, Any]]:
        code, body = self._request("GET", path)
        if code != 200:
            raise RuntimeError(f"list {path}: {code} {body}")
        return list(body.get("items") or [])

    def wait_for(self, predicate: Any, timeout: float = 5.0) -> bool:
        """The real server has no change hook here; a short poll (tests only)."""
        deadline = time.monotonic() + timeout
        while True:
            if predicate(self):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)


_REAL: Dict[Tuple[str, bool], RealApiServer] = {}  # one per process: etcd + apiserver ~3 s


def _real_server(assets: str, device_taints: bool) -> RealApiServer:
    server = _REAL.get((assets, device_taints))
    if server is None:
        server = RealApiServer(assets, device_taints)
        server.start()
        atexit.register(server.close)
        _REAL[(assets, device_taints)] = server
    return server


def api_server_under_test(device_taints: bool = False) -> Iterator[Any]:
    """The real API server where KUBEBUILDER_ASSETS says so, else the stand-in.

    The real one is started once per process and emptied for each test (``reset``): its
    start costs seconds, a fresh stand-in nothing."""
    assets = kubebuilder_assets()
    if assets:
        server = _real_server(assets, device_taints)
        server.reset()
        yield server
        return
    with ApiServerStandIn(device_taints=device_taints) as standin:
        yield standin




def _fixture() -> Any:
    try:
        import pytest
    except ImportError:  # the benchmarks use the stand-in without pytest
        return None

    @pytest.fixture
    def kube_api() -> Iterator[Any]:
        """The API server for a test: real with KUBEBUILDER_ASSETS, else the stand-in.

        Import it into a test module or conftest: ``from host.sim.apiserver import
        kube_api``. Tests of counters or failure injection take ``ApiServerStandIn`` itself.
        """
        yield from api_server_under_test()

    return kube_api


kube_api = _fixture()


__all__ = ["ApiServerStandIn", "RealApiServer", "api_server_under_test", "kube_api",
           "kubebuilder_assets", "parse_field_selector", "status_body"]
