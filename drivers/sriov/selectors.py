"""VF index ranges in the SR-IOV network device plugin's notation, so its configs carry over.

``"ens1f0#0-3,6"`` selects VFs 0, 1, 2, 3 and 6 of the PF whose interface is ens1f0; the same
suffix works after a PF PCI address (its ``rootDevices``) and alone in ``vf_index``. Parsing
is strict and happens at config time: a typo must fail loudly, not select nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

from device_plugin_host import IndexRanges, parse_ranges

__all__ = ["IndexRanges", "PfSelector", "index_ranges", "parse_pf", "parse_ranges"]


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
