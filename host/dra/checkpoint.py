"""The claims this host has prepared, on disk, so a restarted host can still unprepare them.

The kubelet calls NodeUnprepareResources for a claim long after it was prepared, perhaps to
a host process started since; and it calls NodePrepareResources again after its own restart,
expecting the same devices. So every prepared claim is recorded with what was
returned and which CDI spec files it owns, and the file is replaced atomically before a
prepare is answered. A damaged or unreadable checkpoint is moved aside (never silently
reused) with one error line and the host starts with no prepared claims: unprepare of an
unknown claim succeeds, so the kubelet is not blocked, and the moved file keeps the evidence.

Each prepared device also records its hardware footprint (host.dra.hardware), so a restarted
host still refuses to hand out what a prepared claim holds, and each claim records the CDI
specs it wrote: ``/var/run/cdi`` is a tmpfs, and a spec lost while the claim stays prepared
(the directory emptied by hand, a host restart into a fresh mount namespace) is written again
at start. The file records the boot it was written in (the kernel's boot id): after a reboot
no container of the old boot holds anything, so its claims are dropped (the kubelet prepares
them again for the pods it restarts).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import fcntl
import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any, AsyncIterator, Callable, Dict, List, Mapping, Optional, Tuple

from host.core.fileio import write_atomic

log = logging.getLogger(__name__)

FILE_NAME = "prepared-claims.json"
LOCK_NAME = "serialize.lock"  # as kubeletplugin's rolling-update lock file
FORMAT_VERSION = 1
BOOT_ID = "/proc/sys/kernel/random/boot_id"


def read_boot_id(host: Any) -> str:
    """The kernel's boot id through a HostFS (host.core.hostfs), "" where it cannot be read."""
    return host.read(BOOT_ID) or ""


@dataclass(frozen=True)
class PreparedDevice:
    """One device of a prepared claim: what the kubelet got, and which of ours it is."""

    request_names: Tuple[str, ...]
    pool_name: str
    device_name: str
    cdi_device_ids: Tuple[str, ...]
    resource: str  # the configured resource name the pool belongs to
    device_id: str  # Device.id
    hardware: Tuple[str, ...] = ()  # host.dra.hardware.footprint at prepare time
    share_id: str = ""  # the allocation's shareID: a share of a device (host.dra.sharing)
    shares: int = 0  # how many shares of the device it holds (a replica: 1)


@dataclass(frozen=True)
class PreparedClaim:
    uid: str
    namespace: str
    name: str
    devices: Tuple[PreparedDevice, ...]
    cdi_files: Tuple[str, ...] = ()
    pod_uids: Tuple[str, ...] = ()
    prepared_at: float = field(default_factory=time.time)
    cdi_specs: Mapping[str, Any] = field(default_factory=dict)  # path -> the spec written


class Checkpoint:
    """In memory, mirrored to ``<state_dir>/prepared-claims.json`` on every change.

    ``put``/``remove`` write synchronously; the DRA service uses ``aput``/``aremove``, which
    run the fsynced write on one worker thread of the checkpoint's own, so the event loop
    (every other resource's gRPC traffic) never waits on the disk and writes never race.
    """

    def __init__(self, state_dir: str, boot_id: str = "") -> None:
        self.path = os.path.join(state_dir, FILE_NAME)
        self.boot_id = boot_id  # "" where the kernel does not say: no reboot is detected
        self.claims: Dict[str, PreparedClaim] = {}
        # Footprints of claims being prepared right now, by claim uid: checked and taken in
        # one step on the event loop, so two concurrent prepares cannot both pass the check.
        self.reserved: Dict[str, Tuple[str, ...]] = {}
        # Shares those claims take, by claim uid: (the shared device's keys, count) each.
        self.reserved_shares: Dict[str, List[Tuple[Tuple[str, ...], int]]] = {}
        self._io: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._seen: Optional[Tuple[int, int, int]] = None  # the file as last read or written
        self._lock_path = os.path.join(state_dir, LOCK_NAME)
        self._lock_fd: Optional[int] = None
        self._users = 0
        self._gate: Optional[asyncio.Lock] = None

    @contextlib.asynccontextmanager
    async def shared(self) -> AsyncIterator[None]:
        """Exclusive use of the checkpoint among the host processes of this node, for one
        prepare or unprepare call.

        During an upgrade two hosts serve the same driver and the kubelet may call either
        (it prefers the newer, but a claim prepared by one may be unprepared by the other).
        Both keep the same file, so each call runs under an flock of
        ``<state_dir>/serialize.lock`` (what k8s.io/dynamic-resource-allocation's
        ``RollingUpdate`` does), and the file is read again when another process changed it
        since: a claim prepared by the other host is answered from the record (prepare is
        idempotent across the two), and its devices count as held. Calls of one process
        share the flock (it is taken by the first and dropped by the last), so a single host
        keeps its concurrency; an uncontended flock costs one system call."""
        if self._gate is None:
            self._gate = asyncio.Lock()
        async with self._gate:
            if self._users == 0:
                await asyncio.get_running_loop().run_in_executor(None, self._take_lock)
                self.refresh()
            self._users += 1
        try:
            yield
        finally:
            self._users -= 1
            if self._users == 0 and self._lock_fd is not None:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def _take_lock(self) -> None:
        if self._lock_fd is None:
            os.makedirs(os.path.dirname(self._lock_path) or ".", mode=0o700, exist_ok=True)
            self._lock_fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW
                                    | os.O_CLOEXEC, 0o600)
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX)

    def _stat(self) -> Optional[Tuple[int, int, int]]:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def refresh(self) -> bool:
        """Read the file again if another process replaced it since we last read or wrote it;
        whether it was read. Called with the shared lock held."""
        seen = self._stat()
        if seen == self._seen:
            return False
        if seen is None:
            self.claims = {}
        else:
            try:
                with open(self.path, "rb") as stream:
                    self.claims = decode_claims(stream.read().decode("utf-8"))
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
                log.error("DRA checkpoint %s changed under us and cannot be read (%s); keeping"
                          " what this host knew", self.path, error)
        self._seen = seen
        return True

    async def aput(self, claim: PreparedClaim) -> None:
        await self._off_loop(self.put, claim)

    async def aremove(self, uid: str) -> None:
        await self._off_loop(self.remove, uid)

    async def _off_loop(self, fn: Callable[[Any], None], arg: Any) -> None:
        if self._io is None:
            self._io = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="dra-checkpoint")
        await asyncio.get_running_loop().run_in_executor(self._io, fn, arg)

    def close(self) -> None:
        if self._io is not None:
            self._io.shutdown(wait=True)
            self._io = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def load(self) -> None:
        """Read the file; never raises. A damaged or unreadable file is moved aside and a
        file from an earlier boot is emptied (its CDI spec files removed, where left)."""
        try:
            with open(self.path, "rb") as stream:
                text = stream.read().decode("utf-8")
            document = json.loads(text)
            self.claims = decode_claims(text)
            self._seen = self._stat()
        except FileNotFoundError:
            return
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
            self._move_aside(error)
            return
        booted = str(document.get("boot_id") or "")
        if booted and self.boot_id and booted != self.boot_id and self.claims:
            count = len(self.claims)
            for claim in self.claims.values():
                for path in claim.cdi_files:
                    try:
                        os.unlink(path)
                    except OSError:
                        pass
            self.claims = {}
            log.warning("DRA checkpoint %s: dropped %d claim%s prepared before the last reboot"
                        " (boot %s); the kubelet prepares them again", self.path, count,
                        "" if count == 1 else "s", booted)
            try:
                self._save(self.claims)
            except OSError as error:
                log.error("DRA checkpoint %s cannot be saved: %s", self.path, error)

    def _move_aside(self, error: BaseException) -> None:
        aside = f"{self.path}.corrupt-{int(time.time())}"
        what = getattr(error, "strerror", None) or str(error) or type(error).__name__
        try:
            os.replace(self.path, aside)
            where = f"moved to {aside}"
        except OSError as move_error:
            where = f"and cannot be moved aside ({move_error.strerror or move_error})"
        log.error("DRA checkpoint %s is damaged or unreadable (%s); %s, starting with no "
                  "prepared claims", self.path, what, where)
        self.claims = {}

    def restore_specs(self) -> int:
        """Write again every recorded CDI spec that is missing; returns how many. A spec that
        cannot be written is logged (its claim's next prepare tries again)."""
        from host.dra.claim_cdi import write_claim_spec

        restored = 0
        for claim in self.claims.values():
            for path, spec in claim.cdi_specs.items():
                if os.path.exists(path):
                    continue
                try:
                    write_claim_spec(path, spec)
                except OSError as error:
                    log.error("DRA claim %s/%s: cannot write its CDI spec %s again: %s",
                              claim.namespace, claim.name, path, error.strerror or error)
                    continue
                restored += 1
        if restored:
            log.info("DRA: wrote %d missing CDI spec%s of prepared claims again", restored,
                     "" if restored == 1 else "s")
        return restored

    def get(self, uid: str) -> Optional[PreparedClaim]:
        return self.claims.get(uid)

    def put(self, claim: PreparedClaim) -> None:
        """Record a claim; raises OSError (and records nothing) when it cannot be saved."""
        claims = dict(self.claims)
        claims[claim.uid] = claim
        self._save(claims)
        self.claims = claims

    def remove(self, uid: str) -> None:
        if uid not in self.claims:
            return
        claims = dict(self.claims)
        del claims[uid]
        self._save(claims)
        self.claims = claims

    def _save(self, claims: Dict[str, PreparedClaim]) -> None:
        document = {"version": FORMAT_VERSION, "boot_id": self.boot_id,
                    "claims": [asdict(claim) for claim in claims.values()]}
        write_atomic(self.path, json.dumps(document, indent=1, sort_keys=True) + "\n",
                     mode=0o600, durable=True, make_dirs=True)
        self._seen = self._stat()


def decode_claims(text: str) -> Dict[str, PreparedClaim]:
    document = json.loads(text)
    if not isinstance(document, dict) or document.get("version") != FORMAT_VERSION:
        raise ValueError(f"not a version {FORMAT_VERSION} checkpoint")
    out: Dict[str, PreparedClaim] = {}
    for raw in document["claims"]:
        devices: List[PreparedDevice] = [
            PreparedDevice(
                request_names=tuple(str(n) for n in d["request_names"]),
                pool_name=str(d["pool_name"]), device_name=str(d["device_name"]),
                cdi_device_ids=tuple(str(i) for i in d["cdi_device_ids"]),
                resource=str(d["resource"]), device_id=str(d["device_id"]),
                hardware=tuple(str(k) for k in d.get("hardware", ())),
                share_id=str(d.get("share_id") or ""), shares=int(d.get("shares") or 0),
            )
            for d in raw["devices"]
        ]
        claim = PreparedClaim(
            uid=str(raw["uid"]), namespace=str(raw["namespace"]), name=str(raw["name"]),
            devices=tuple(devices), cdi_files=tuple(str(f) for f in raw.get("cdi_files", ())),
            pod_uids=tuple(str(p) for p in raw.get("pod_uids", ())),
            prepared_at=float(raw.get("prepared_at", 0.0)),
            cdi_specs={str(k): v for k, v in dict(raw.get("cdi_specs") or {}).items()},
        )
        out[claim.uid] = claim
    return out
