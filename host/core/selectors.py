"""Selectors matched by the host: a resource's ``[resource.selectors]`` against the facts a
driver put in ``Device.attributes``.

Most selectors name a fact the driver already reports (``vendor``, ``device``,
``kernel_driver``, ``pci_address``, ``class``, a model name), so the host matches them and a
driver only scans. The rules are the ones every built-in driver used on its own before:

* a list means any of its values; a fact the device lacks matches nothing;
* ``vendor``, ``device``, ``subsystem_vendor``, ``subsystem_device``: hex ids in any case and
  width, with or without ``0x``, or TOML integers (``"0x10DE"``, ``"10de"``, ``4318``);
* ``pci_address``: the full form or lspci's short one (``3b:00.0`` for ``0000:3b:00.0``);
* ``class``: a PCI class prefix of 2, 4 or 6 hex digits (``host.sysfs.pci_class``);
* any other key: the exact string; an integer matches a decimal fact (``index = 3``), and a
  range string ``"0-3,6"`` (the SR-IOV device plugin's notation) matches a decimal fact in it.

A driver whose selector needs more (an SR-IOV PF with a VF range, MIG placement, a set of QAT
services) overrides ``Driver.selector_test`` for that key only. This module imports nothing of
the host, so ``host.core.driver`` and the PCI helpers can both build on it.
"""

from __future__ import annotations

import re
from typing import Callable, List, Mapping, Optional, Sequence, Set, Tuple

#: A compiled selector: True when a device's attributes satisfy it.
AttributeTest = Callable[[Mapping[str, str]], bool]
ClassPattern = Tuple[int, int]

#: Selector keys whose values are hex ids (PCI config space ids as sysfs prints them).
HEX_ID_KEYS = frozenset({"vendor", "device", "subsystem_vendor", "subsystem_device"})

_HEX = re.compile(r"[0-9a-f]+\Z")
_RANGES = re.compile(r"\s*\d+\s*(-\s*\d+\s*)?(,\s*\d+\s*(-\s*\d+\s*)?)*\Z")


class IndexRanges:
    """Inclusive index spans, ``"0-3,6"``; a plain class, not a tuple, which selector values
    must not look like."""

    __slots__ = ("spans",)

    def __init__(self, spans: Tuple[Tuple[int, int], ...]) -> None:
        self.spans = spans

    def __eq__(self, other: object) -> bool:
        return type(other) is IndexRanges and other.spans == self.spans

    def __hash__(self) -> int:
        return hash(self.spans)

    def __repr__(self) -> str:
        return f"IndexRanges({self.spans!r})"

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


def class_pattern(text: str) -> Optional[ClassPattern]:
    """("0x03" -> (0x03, 16)): the value and how far to shift the 24-bit class to compare."""
    text = text.strip().lower()
    digits = text[2:] if text.startswith("0x") else text
    if len(digits) not in (2, 4, 6) or not _HEX.match(digits):
        return None
    return int(digits, 16), 24 - 4 * len(digits)


def class_matches(pci_class: Optional[int], patterns: Sequence[ClassPattern]) -> bool:
    """True when no pattern is given, or the 24-bit class matches one of them."""
    if not patterns:
        return True
    return pci_class is not None and any(pci_class >> shift == value for value, shift in patterns)


def hex_id(value: object) -> Optional[int]:
    """A hex id from config (``"0x10de"``, ``"10DE"``, 4318) or from sysfs text; None when it
    is not one."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    text = str(value).strip().lower()
    digits = text[2:] if text.startswith("0x") else text
    return int(digits, 16) if digits and _HEX.match(digits) else None


def normalise_hex_ids(values: Optional[Sequence[object]]) -> Optional[Set[int]]:
    """Selector ids like "0x10de", "10de" or 4318 as a set of ints; None when ``values`` is.
    Raises ValueError for a value that is not a hex id."""
    if values is None:
        return None
    out = set()
    for value in values:
        number = hex_id(value)
        if number is None:
            raise ValueError(f"{value!r} is not a hex id")
        out.add(number)
    return out


def _decimal(text: Optional[str]) -> Optional[int]:
    return int(text) if text is not None and text.isascii() and text.isdigit() else None


def _hex_ids(values: Sequence[object], name: str) -> AttributeTest:
    ids = {i for i in (hex_id(v) for v in values) if i is not None}
    return lambda attributes: hex_id(attributes.get(name, "")) in ids


def _pci_address(values: Sequence[object], name: str) -> AttributeTest:
    wanted = {str(v) for v in values}

    def address(attributes: Mapping[str, str]) -> bool:
        actual = attributes.get(name)
        return actual is not None and (
            actual in wanted or (actual.startswith("0000:") and actual[5:] in wanted))

    return address


def _pci_class(values: Sequence[object], name: str) -> AttributeTest:
    patterns = [p for p in (class_pattern(str(v)) for v in values) if p is not None]
    if not patterns:
        return lambda attributes: True  # nothing valid (check_selectors refuses that)

    def pci_class(attributes: Mapping[str, str]) -> bool:
        return class_matches(hex_id(attributes.get(name, "")), patterns)

    return pci_class


def _general(values: Sequence[object], name: str) -> AttributeTest:
    exact: Set[str] = set()
    numbers: Set[int] = set()
    ranges: List[IndexRanges] = []
    for value in values:
        if isinstance(value, int) and not isinstance(value, bool):
            numbers.add(value)
            continue
        text = str(value)
        exact.add(text)
        if _RANGES.match(text) and ("-" in text or "," in text):
            ranges.append(parse_ranges(text))
    if not numbers and not ranges:
        return lambda attributes: attributes.get(name) in exact

    def general(attributes: Mapping[str, str]) -> bool:
        actual = attributes.get(name)
        if actual is None:
            return False
        if actual in exact:
            return True
        number = _decimal(actual)
        return number is not None and (number in numbers or any(number in r for r in ranges))

    return general


#: One filter per selector key with a meaning of its own: (values, attribute name) -> test.
#: Every other key is ``_general``. A driver adds a key of its own by overriding
#: ``Driver.selector_test`` for it.
FILTERS: Mapping[str, Callable[[Sequence[object], str], AttributeTest]] = {
    **{key: _hex_ids for key in HEX_ID_KEYS},
    "pci_address": _pci_address,
    "class": _pci_class,
}


def attribute_test(key: str, values: Sequence[object],
                   attribute: Optional[str] = None) -> AttributeTest:
    """The host's test for one selector ``key`` with its ``values`` (any of them), against
    the device attribute ``attribute`` (default: the key's own name). Values are parsed once
    here, not per device."""
    return FILTERS.get(key, _general)(values, attribute or key)


def all_of(tests: Sequence[AttributeTest]) -> AttributeTest:
    """Every selector of a resource must hold; no selectors match every device."""
    if not tests:
        return lambda attributes: True
    if len(tests) == 1:
        return tests[0]
    return lambda attributes: all(test(attributes) for test in tests)
