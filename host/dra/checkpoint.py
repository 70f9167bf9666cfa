"""The claims this host has prepared, on disk, so a restarted host can still unprepare them.

The kubelet calls NodeUnprepareResources for a claim long after it was prepared, perhaps to
a host process started since; and it calls NodePrepareResources again after its own restart,
expecting the same devices (facts §3). So every prepared claim is recorded with what was
returned and which CDI spec files it owns, and the file is replaced atomically before a
prepare is answered. A damaged checkpoint is moved aside (never silently reused) and the host
starts with no prepared claims: unprepare of an unknown claim succeeds, so the kubelet is not
blocked, and the moved file keeps the evidence.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

from host.dra.atomic import write_atomic

log = logging.getLogger(__name__)

FILE_NAME = "prepared-claims.json"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class PreparedDevice:
    """One device of a prepared claim: what the kubelet got, and which of ours it is."""

    request_names: Tuple[str, ...]
    pool_name: str
    device_name: str
    cdi_device_ids: Tuple[str, ...]
    resource: str  # the configured resource name the pool belongs to
    device_id: str  # Device.id


@dataclass(frozen=True)
class PreparedClaim:
    uid: str
    namespace: str
    name: str
    devices: Tuple[PreparedDevice, ...]
    cdi_files: Tuple[str, ...] = ()
    pod_uids: Tuple[str, ...] = ()
    prepared_at: float = field(default_factory=time.time)


class Checkpoint:
    """In memory, mirrored to ``<state_dir>/prepared-claims.json`` on every change.

    ``put``/``remove`` write synchronously; the DRA service uses ``aput``/``aremove``, which
    run the fsynced write on one worker thread of the checkpoint's own, so the event loop
    (every other resource's gRPC traffic) never waits on the disk and writes never race.
    """

    def __init__(self, state_dir: str) -> None:
        self.path = os.path.join(state_dir, FILE_NAME)
        self.claims: Dict[str, PreparedClaim] = {}
        self._io: Optional[concurrent.futures.ThreadPoolExecutor] = None

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

    def load(self) -> None:
        try:
            with open(self.path, encoding="utf-8") as stream:
                text = stream.read()
        except FileNotFoundError:
            return
        try:
            self.claims = decode_claims(text)
        except (ValueError, KeyError, TypeError) as error:
            aside = f"{self.path}.corrupt-{int(time.time())}"
            log.error("DRA checkpoint %s is damaged (%s); moved to %s, starting with no "
                      "prepared claims", self.path, error, aside)
            try:
                os.replace(self.path, aside)
            except OSError:
                pass
            self.claims = {}

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
        document = {"version": FORMAT_VERSION,
                    "claims": [asdict(claim) for claim in claims.values()]}
        write_atomic(self.path, json.dumps(document, indent=1, sort_keys=True) + "\n", 0o600)


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
            )
            for d in raw["devices"]
        ]
        claim = PreparedClaim(
            uid=str(raw["uid"]), namespace=str(raw["namespace"]), name=str(raw["name"]),
            devices=tuple(devices), cdi_files=tuple(str(f) for f in raw.get("cdi_files", ())),
            pod_uids=tuple(str(p) for p in raw.get("pod_uids", ())),
            prepared_at=float(raw.get("prepared_at", 0.0)),
        )
        out[claim.uid] = claim
    return out
