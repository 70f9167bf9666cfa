"""Which hardware a DRA device occupies, so a prepare never hands out what a prepared claim holds.

The scheduler knows only what the slices say; a whole GPU and its MIG devices, or an AMD GPU in
SPX and its CPX partitions after a repartition, are unrelated to it unless counters tie them.
NodePrepareResources is the last place that can refuse, and it must know what earlier claims
hold even after the devices they got are gone from the pools (a GPU withdrawn when it went into
MIG mode) or the host restarted: so each prepared device's footprint is computed from its
Device record at prepare time and checkpointed with it.

A footprint is a tuple of keys, read from Device facts only:

* ``pci:<address>`` for a device that is a whole PCI function (attribute ``pci_address``);
* ``pci:<address>#mig:<gi>/<ci>`` for a MIG device (``mig_gi``, ``mig_ci``) and
  ``pci:<address>#part:<n>`` for a compute partition (``partition_index``) of that function;
* ``node:<path>`` for each device node of a device without a PCI address that no other
  device of its pool has (a control node such as ``/dev/nvidiactl`` is on all of them);
* ``share:<key>`` for each key of a device used by several claims at once (a share of a
  device published for several allocations, host.dra.sharing); a replica (``replica_of``: a
  share published as a device of its own) has those of its device plus ``replica:<id>``.

Two footprints overlap where a whole function meets anything on that function (parent and
child), two keys are equal (the same partition twice, a shared device node), or the same
replica is handed out twice. Partitions of one function with different indexes do not, and
neither do two shares of one device (how many shares are out is counted apart); a share and
the whole device, or a share and a partition of its function, do.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import Iterable, Mapping, Optional, Sequence, Tuple

from host.core.model import Device


def node_counts(pool: Iterable[Device]) -> Mapping[str, int]:
    """How many devices of a pool have each device node (once per pool, not per device)."""
    return Counter(n.host_path for d in pool for n in d.device_nodes)


def footprint(device: Device, counts: Mapping[str, int]) -> Tuple[str, ...]:
    """The keys of ``device``; ``counts``: ``node_counts`` of the devices served with it
    (a node more than one of them has is a control node)."""
    attributes = device.attributes
    if attributes.get("replica_of"):
        whole = footprint(replace(device, attributes={
            k: v for k, v in attributes.items() if k != "replica_of"}), counts)
        return (f"replica:{device.id}", *shared(whole))
    address = attributes.get("pci_address")
    if address:
        gi, ci = attributes.get("mig_gi"), attributes.get("mig_ci")
        if gi is not None and ci is not None:
            return (f"pci:{address}#mig:{gi}/{ci}",)
        index = attributes.get("partition_index")
        if index is not None:
            return (f"pci:{address}#part:{index}",)
        return (f"pci:{address}",)
    keys = [f"node:{n.host_path}" for n in device.device_nodes
            if counts.get(n.host_path, 1) <= 1]
    return tuple(keys) if keys else (f"device:{device.id}",)


def shared(keys: Sequence[str]) -> Tuple[str, ...]:
    """The footprint of a share of a device whose whole footprint is ``keys``."""
    return tuple(k if k.startswith(("share:", "replica:")) else f"share:{k}" for k in keys)


def conflict(mine: Sequence[str], theirs: Sequence[str]) -> Optional[str]:
    """Why two footprints overlap ("the same GPU function 0000:3b:00.0"), or None."""
    for a in mine:
        for b in theirs:
            why = _pair(a, b)
            if why:
                return why
    return None


def _pair(a: str, b: str) -> Optional[str]:
    share_a, share_b = a.startswith("share:"), b.startswith("share:")
    if share_a or share_b:
        if share_a and share_b:
            return None  # shares of one device coexist; their number is counted apart
        why = _pair(a[6:] if share_a else a, b[6:] if share_b else b)
        return f"a share of a device used whole or partitioned elsewhere: {why}" if why else None
    if a == b:
        kind, _, what = a.partition(":")
        return {"pci": f"the same PCI function {what}",
                "node": f"the same device node {what}",
                "replica": f"the same replica {what}"}.get(kind, f"the same device {what}")
    if a.startswith("pci:") and b.startswith("pci:"):
        whole_a, _, part_a = a[4:].partition("#")
        whole_b, _, part_b = b[4:].partition("#")
        if whole_a == whole_b and not (part_a and part_b):
            return f"PCI function {whole_a} and its partition {part_a or part_b}"
    return None
