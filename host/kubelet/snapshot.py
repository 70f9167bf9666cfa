"""The current device list of one resource, encoded once, waited on by ListAndWatch streams.

Only what the kubelet sees (id, health, NUMA nodes) decides whether a device's encoding is
reused, so a rescan that rebuilds 10,000 Device objects re-encodes only the ones whose wire
form changed, and the new payload is the old one's unchanged stretches joined with the new
encodings.

Memory: a node may carry 10,000 devices for as long as the host runs. The encodings live only
inside the payload (the bytes the kubelet is sent), found again through an array of their
lengths, and each device is kept once, in the dict Allocate looks ids up in: about 60 bytes a
device besides the Device itself, where a (device, wire key, encoding) tuple per device and a
separate payload took about 200.

Speed: where the new list holds other objects than the old one, and where its ids start to
differ from the front and from the back, is found in C (``map`` over both lists), so the
devices that stayed the same objects, or kept their id and place, cost no Python step; only
those in between (a hot-plug adds or removes a few) are matched one by one.
"""

from __future__ import annotations

import asyncio
from array import array
from itertools import accumulate, compress, count
from operator import attrgetter, is_not, ne
from typing import Dict, List, Optional, Sequence, Tuple, Union

from host.core.model import Device
from host.kubelet.protocol.convert import framed_device

# 4 bytes, unsigned, on every platform CPython supports: one device's encoding is an id of at
# most 256 bytes, a health and its NUMA nodes.
_LENGTHS = "I"
# Up to this many new objects among the same ids are swapped into the dict in place; more
# rebuild it, so that its keys are the new devices' own id strings and the old ones are freed
# with the old devices (a driver's rescan returns all-new objects).
_IN_PLACE = 64
_id = attrgetter("id")
_seen = attrgetter("id", "health", "numa_nodes")  # all of a device the kubelet sees
_Piece = Union[bytes, memoryview]


def _aligned(new: Sequence[Device], old: Sequence[Device],
             limit: int) -> Tuple[int, List[int], List[int]]:
    """How many leading places (at most ``limit``) hold the same ids in both lists, which of
    those places hold a device whose wire form changed, and where (anywhere) the two lists
    hold other objects."""
    renewed = list(compress(count(), map(is_not, new, old)))  # other objects than before
    changed = compress(renewed, map(ne, map(_seen, map(new.__getitem__, renewed)),
                                    map(_seen, map(old.__getitem__, renewed))))
    rewire: List[int] = []
    for at in changed:  # lazily: the scan stops at the first other id
        if at >= limit or new[at].id != old[at].id:
            return min(at, limit), rewire, renewed
        rewire.append(at)
    return limit, rewire, renewed


class Snapshot:
    def __init__(self) -> None:
        self.version = 0
        self._devices: Dict[str, Device] = {}  # in advertised order
        self._lengths = array(_LENGTHS)  # each device's encoding's length in _payload
        self._payload = b""
        self._changed: Optional[asyncio.Future] = None

    def update(self, devices: Sequence[Device]) -> bool:
        """Replace the device list; True (and streams woken) when the kubelet's view changed."""
        if not self._apply(devices):
            return False
        self.version += 1
        waiter, self._changed = self._changed, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        return True

    def _apply(self, devices: Sequence[Device]) -> bool:
        old = list(self._devices.values())
        n, m = len(devices), len(old)
        shorter = min(n, m)
        head, rewire, renewed = _aligned(devices, old, shorter)
        if head == n == m:  # the same ids in the same order: a rescan, a health change
            if len(renewed) > _IN_PLACE:
                self._devices = dict(zip(map(_id, devices), devices))
            else:
                for at in renewed:
                    self._devices[old[at].id] = devices[at]  # same key: its place stays
            if not rewire:
                return False
            pieces: List[_Piece] = []
            lengths = array(_LENGTHS)
            self._splice(pieces, lengths, 0, m, 0, [(at, devices[at]) for at in rewire])
            self._payload = b"".join(pieces)
            self._lengths = lengths
            return True
        entries = dict(zip(map(_id, devices), devices))
        if len(entries) != n:
            # Ids repeat (sanitize never lets that through): each id once, at its first place
            # with its last record, as the dict keeps them.
            self._apply(list({d.id: d for d in devices}.values()))
            return True  # the list the kubelet had never repeats an id: this one differs
        new_back, old_back = devices[::-1], old[::-1]
        tail, back_rewire, _ = _aligned(new_back, old_back, shorter - head)
        pieces = []
        lengths = array(_LENGTHS)
        offset = self._splice(pieces, lengths, 0, head, 0, [(at, devices[at]) for at in rewire])
        offset = self._match(pieces, lengths, devices[head:n - tail], old, head, m - tail,
                             offset)
        self._splice(pieces, lengths, m - tail, m, offset,
                     [(m - 1 - at, new_back[at]) for at in reversed(back_rewire)])
        self._devices = entries
        self._payload = b"".join(pieces)
        self._lengths = lengths
        return True

    def _splice(self, pieces: List[_Piece], lengths: array[int], first: int, last: int,
                offset: int, rewire: List[Tuple[int, Device]]) -> int:
        """Old places ``first`` to ``last`` (their bytes begin at ``offset``) kept as they
        were but for ``rewire``, (place, new device) pairs in order: each a new encoding in
        the old one's stead. Returns where the old bytes of ``last`` begin."""
        old_lengths = self._lengths
        payload = memoryview(self._payload)
        done, position = offset, first
        for at, device in rewire:
            data = framed_device(device)
            start = done + sum(old_lengths[position:at])
            pieces += (payload[done:start], data)
            lengths.extend(old_lengths[position:at])
            lengths.append(len(data))
            done = start + old_lengths[at]
            position = at + 1
        end = done + sum(old_lengths[position:last])
        pieces.append(payload[done:end])
        lengths.extend(old_lengths[position:last])
        return end

    def _match(self, pieces: List[_Piece], lengths: array[int], new: Sequence[Device],
               old_all: Sequence[Device], first: int, last: int, offset: int) -> int:
        """New devices between the aligned head and tail, matched by id against the old
        places ``first`` to ``last`` (their bytes begin at ``offset``): the old encoding
        where the wire form is the same, runs of them taken as one slice. Returns where the
        old bytes of ``last`` begin."""
        payload = memoryview(self._payload)
        old = old_all[first:last]
        index = dict(zip(map(_id, old), count()))
        starts = list(accumulate(self._lengths[first:last], initial=offset))
        run_start = run_end = offset  # old bytes carried over, not yet in pieces
        for device in new:
            at = index.get(device.id)
            if at is not None:
                before = old[at]
                if before is device or _seen(before) == _seen(device):
                    start = starts[at]
                    end = starts[at + 1]
                    if start != run_end:
                        pieces.append(payload[run_start:run_end])
                        run_start = start
                    run_end = end
                    lengths.append(end - start)
                    continue
            pieces.append(payload[run_start:run_end])
            run_start = run_end = 0
            data = framed_device(device)
            pieces.append(data)
            lengths.append(len(data))
        pieces.append(payload[run_start:run_end])
        return starts[-1]

    def device(self, device_id: str) -> Optional[Device]:
        return self._devices.get(device_id)

    def __len__(self) -> int:
        return len(self._devices)

    @property
    def devices(self) -> List[Device]:
        return list(self._devices.values())

    @property
    def payload(self) -> bytes:
        """The serialized ListAndWatchResponse for the current version."""
        return self._payload

    async def next_payload(self, seen_version: int) -> Tuple[int, bytes]:
        """The payload newer than ``seen_version``, waiting for a change when there is none."""
        while self.version == seen_version:
            if self._changed is None:
                self._changed = asyncio.get_running_loop().create_future()
            await asyncio.shield(self._changed)
        return self.version, self.payload
