"""VF index ranges in the SR-IOV network device plugin's notation, so its configs carry over.

``"ens1f0#0-3,6"`` selects VFs 0, 1, 2, 3 and 6 of the PF whose interface is ens1f0; the same
suffix works after a PF PCI address (its ``rootDevices``) and alone in ``vf_index``. Parsing
is strict and happens at config time: a typo must fail loudly, not select nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple


@dataclass(frozen=True)
class IndexRanges:
    spans: Tuple[Tuple[int, int], ...]

    def __contains__(self, index: object) -> bool:
        return isinstance(index, int) and any(lo <= index <= hi for lo, hi in self.spans)


def parse_ranges(text: str) -> IndexRanges:
    """``"0-3,6"`` -> spans (0, 3), (6, 6). Raises ValueError naming the bad part."""
    spans = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            raise ValueError(f"empty entry in VF range {text!r}")
        lo_text, dash, hi_text = part.partition("-")
        lo_text, hi_text = lo_text.strip(), hi_text.strip()
        if not lo_text.isdigit() or (dash and not hi_text.isdigit()):
            raise ValueError(f"{part!r} is not a VF index or range like 0-3")
        lo = int(lo_text)
        hi = int(hi_text) if dash else lo
        if hi < lo:
            raise ValueError(f"range {part!r} ends before it starts")
        spans.append((lo, hi))
    return IndexRanges(tuple(spans))


def index_ranges(value: object) -> IndexRanges:
    """A ``vf_index`` selector value: an int or a range string."""
    if isinstance(value, bool):
        raise ValueError("a VF index is not a boolean")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"VF index {value} is negative")
        return IndexRanges(((value, value),))
    return parse_ranges(str(value))


@dataclass(frozen=True)
class PfSelector:
    """``name`` (an interface or a PCI address) with an optional ``#ranges`` suffix."""

    name: str
    ranges: Optional[IndexRanges]

    def matches(self, names: Tuple[str, ...], index: int) -> bool:
        if self.name not in names:
            return False
        return self.ranges is None or index in self.ranges


def parse_pf(text: str) -> PfSelector:
    name, hash_, rest = text.partition("#")
    name = name.strip()
    if not name:
        raise ValueError(f"{text!r} has no PF before '#'")
    if not hash_:
        return PfSelector(name, None)
    if "#" in rest:
        raise ValueError(f"{text!r} has more than one '#'")
    return PfSelector(name, parse_ranges(rest))
