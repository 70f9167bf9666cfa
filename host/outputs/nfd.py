"""Node labels through Node Feature Discovery's ``local`` source: one feature file, no API server.

nfd-worker reads every file in ``/etc/kubernetes/node-feature-discovery/features.d/`` at each
re-discovery (once a minute by default) and turns each ``<key>=<value>`` line into a node
label (NFD's customization guide, "Local feature source"): ``#`` lines are comments, a key
without a value means ``true``, a key without a ``<namespace>/`` is prefixed with
``feature.node.kubernetes.io/`` (deprecated: a future NFD stops doing that), a file over 64 kB
is ignored whole, and a ``# +expiry-time=<RFC 3339>`` line makes the lines after it count only
until then. nfd-master refuses label namespaces under kubernetes.io other than
feature.node.kubernetes.io, and whatever ``-deny-label-ns`` lists.

So every label here is namespaced by its resource, the way the vendors' own feature
discovery names them: resource ``nvidia.com/gpu`` gives ``nvidia.com/gpu.count=8``,
``nvidia.com/gpu.product=NVIDIA-H100-80GB-HBM3``, ``nvidia.com/gpu.memory=81559`` (MiB) and so
on. Values come from the devices' attributes (``vendor``, ``device``, ``product_name``,
``memory_bytes``, ``partition_mode``) where a driver sets them; a label no device supports is
left out, never guessed. No expiry line is written: the file is removed on a clean stop, and
a host that died leaves labels that still describe the hardware until it runs again.

The file is written atomically (a temporary file in the same directory, then a rename, so NFD
never reads half of it) and only when its text changes; it is never created in a directory
that does not exist (a node without NFD gets no stray /etc/kubernetes tree).
"""

from __future__ import annotations

import logging
import os
import re
from typing import Dict, Iterable, List, Mapping, Optional, Sequence

from host.core import fileio
from host.core.model import Device, ResourceConfig
from host.core.tasks import Background
from host.outputs import Output

log = logging.getLogger(__name__)
_TIMER = "nfd feature file"

MAX_BYTES = 64 * 1024  # NFD ignores a bigger feature file altogether
_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?\Z")
_BAD_VALUE_CHARS = re.compile(r"[^-A-Za-z0-9_.]+")
HEADER = ("# Written by device-plugin-host from the devices it serves; rewritten when they "
          "change, removed when it stops.\n")


def label_value(text: str) -> str:
    """A label-safe value (63 characters of [-A-Za-z0-9_.], alphanumeric at both ends):
    "NVIDIA H100 80GB HBM3" -> "NVIDIA-H100-80GB-HBM3", as NVIDIA's feature discovery does."""
    value = _BAD_VALUE_CHARS.sub("-", text.strip())[:63]
    return value.strip("-_.")


def _hex_id(text: str) -> str:
    text = text.strip().lower()
    return text[2:] if text.startswith("0x") else text


def resource_labels(resource: str, devices: Sequence[Device]) -> Dict[str, str]:
    """The labels of one resource, keyed ``<resource>.<field>``."""
    out: Dict[str, str] = {"count": str(len(devices))}

    def values(attribute: str) -> List[str]:
        return sorted({d.attributes[attribute] for d in devices if d.attributes.get(attribute)})

    for field, attribute in (("vendor", "vendor"), ("device", "device")):
        ids = [_hex_id(v) for v in values(attribute)]
        if ids:
            out[field] = "_".join(sorted(set(ids)))
    products = [label_value(v) for v in values("product_name")]
    products = [p for p in products if p]
    if products:
        out["product"] = label_value("_".join(sorted(set(products))))
    memory = []
    for value in values("memory_bytes"):
        try:
            memory.append(int(value))
        except ValueError:
            continue
    if memory:
        out["memory"] = str(min(memory) // (1024 * 1024))  # MiB; the smallest a pod can get
    modes = [label_value(v) for v in values("partition_mode")]
    modes = [m for m in modes if m]
    if modes:
        out["partition_mode"] = label_value("_".join(sorted(set(modes))))
    return {f"{resource}.{field}": value for field, value in out.items() if value}


def resource_block(name: str, devices: Sequence[Device]) -> str:
    """The lines of one resource; label names NFD would refuse are left out, logged."""
    slash = "/" in name
    block = []
    for key, value in sorted(resource_labels(name, devices).items()):
        label_name = key.partition("/")[2] if slash else key
        if len(label_name) > 63 or not _NAME.match(label_name):
            log.warning("NFD feature file: %s is not a valid label name; left out", key)
            continue
        block.append(f"{key}={value}\n")
    return "".join(block)


def render(resources: Mapping[str, Sequence[Device]],
           blocks: Optional[Mapping[str, str]] = None) -> str:
    """The whole file; ``blocks`` holds already rendered resources (only changed ones are
    rendered again)."""
    lines = [HEADER]
    size = len(HEADER)
    for name in sorted(resources):
        text = blocks[name] if blocks is not None and name in blocks else \
            resource_block(name, resources[name])
        if size + len(text) > MAX_BYTES:
            log.error("NFD feature file: the labels of %s and after would pass NFD's 64 kB "
                      "limit (it would ignore the whole file); left out", name)
            break
        lines.append(text)
        size += len(text)
    return "".join(lines)


class FeatureFile(Output):
    """The host's one feature file, as an output: ``sync`` per device-plugin resource, the
    file written at start (``synced(first=True)``) and ``delay_s`` after later batches."""

    def __init__(self, path: str, delay_s: float = 1.0,
                 background: Optional[Background] = None) -> None:
        self.path = path
        # The deferred write's timer belongs to the host's owner of background work.
        self._background = background if background is not None else Background("nfd")
        self.delay_s = delay_s
        self._devices: Dict[str, Sequence[Device]] = {}
        self._blocks: Dict[str, str] = {}  # rendered resources; dropped when they change
        self._written: Optional[str] = None
        self._complained = False

    def update(self, resource: str, devices: Iterable[Device]) -> None:
        """Cheap on purpose (it runs where the host pushes snapshots): labels are computed
        at the next flush, and only for resources that changed. Without a file (turned off;
        the path cannot change without a restart) nothing is kept."""
        if not self.path:
            return
        self._devices[resource] = list(devices)
        self._blocks.pop(resource, None)

    def sync(self, resource: ResourceConfig, devices: Sequence[Device]) -> None:
        if resource.api != "dra":
            self.update(resource.name, devices)

    def synced(self, first: bool) -> None:
        if first:
            self.flush()
        else:
            self.schedule()

    async def forget(self, resource: ResourceConfig) -> None:
        self._devices.pop(resource.name, None)
        self._blocks.pop(resource.name, None)

    async def close(self, hand_over: bool) -> None:
        self.remove(keep_file=hand_over)

    def schedule(self) -> None:
        """Flush ``delay_s`` from now, coalescing the changes of a burst of rescans: labels
        have no hurry (nfd-worker rereads the file once a minute), ListAndWatch pushes do."""
        if not self._background.armed(_TIMER) and self.path:
            self._background.later(_TIMER, self.delay_s, self.flush)

    def flush(self) -> bool:
        """Write the file if its text changed; True when it was written."""
        if not self.path:
            return False
        directory = os.path.dirname(self.path)
        if not os.path.isdir(directory):
            if not self._complained:
                log.info("NFD feature file: %s does not exist (NFD not installed?); no node "
                         "labels are written", directory)
                self._complained = True
            return False
        for name, devices in self._devices.items():
            if name not in self._blocks:
                self._blocks[name] = resource_block(name, devices)
        text = render(self._devices, self._blocks)
        if text == self._written:
            return False
        fileio.warn_if_shared(directory, "the NFD features directory")
        try:
            # 0644 whatever the umask: nfd-worker reads it.
            fileio.write_atomic(self.path, text, mode=0o644, prefix=".dph-nfd-")
        except OSError as error:
            if not self._complained:
                log.warning("NFD feature file: cannot write %s: %s", self.path,
                            error.strerror or error)
                self._complained = True
            return False
        self._written = text
        self._complained = False
        log.debug("NFD feature file %s written", self.path)
        return True

    def remove(self, keep_file: bool = False) -> None:
        """On stop: the labels go with the host (NFD drops them at its next pass), unless
        ``keep_file`` (another host serves the node now and writes the same file)."""
        self._background.cancel(_TIMER)
        if self._written is None or keep_file:
            return
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        except OSError as error:
            log.warning("NFD feature file: cannot remove %s: %s", self.path, error)
        self._written = None
