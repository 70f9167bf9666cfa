"""PCI class selectors ("0x12", "0x0b40", "0x120000") shared by the drivers that take one.

A 24-bit class code is base class, subclass and programming interface; operators write the
prefix they care about (lspci -n prints ``0b40``), so a selector of 2, 4 or 6 hex digits is
compared against that many leading digits of the function's class.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from host.core.driver import SelectorError, selector_values
from host.core.selectors import ClassPattern, class_pattern


def check_class_selector(selectors: Mapping[str, object], key: str = "class") -> None:
    for value in selector_values(selectors, key) or []:
        if class_pattern(str(value)) is None:
            raise SelectorError(
                key,
                f'{value!r} is not a PCI class: use 2, 4 or 6 hex digits ("0x12" base'
                ' class, "0x1200" class and subclass, "0x120000" with prog-if)',
            )


def class_patterns(selectors: Mapping[str, object], key: str = "class") -> Sequence[ClassPattern]:
    """The checked patterns of a selector (empty when the selector is absent)."""
    out = []
    for value in selector_values(selectors, key) or []:
        pattern = class_pattern(str(value))
        if pattern is not None:
            out.append(pattern)
    return out
