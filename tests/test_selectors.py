"""Selectors matched by the host against Device.attributes (host/core/selectors.py, Driver.select):
a driver that reports its facts only scans; the rules are the ones the drivers had."""

from __future__ import annotations

from typing import List, Mapping, Sequence

import pytest

from device_plugin_host import Device, Driver, HostFS, ResourceConfig
from host.core.selectors import attribute_test, parse_ranges

NVIDIA = {"vendor": "0x10de", "device": "0x2330", "kernel_driver": "nvidia",
          "pci_address": "0000:3b:00.0", "class": "0x030200", "index": "3", "model": "H100"}
INTEL = {"vendor": "0x8086", "device": "0x7d1d", "kernel_driver": "intel_vpu",
         "pci_address": "0000:00:0b.0", "class": "0x120000", "index": "7"}
PLATFORM = {"kernel_driver": "rockchip-npu", "parent": "fdab0000.npu"}


def _match(key: str, values: Sequence[object], attributes: Mapping[str, str]) -> bool:
    return attribute_test(key, list(values))(attributes)


@pytest.mark.parametrize("value", ["0x10de", "0x10DE", "10de", "0x000010de", 0x10DE])
def test_hex_ids_in_any_case_width_or_as_integers(value):
    assert _match("vendor", [value], NVIDIA)
    assert not _match("vendor", [value], INTEL)


def test_a_list_is_any_of_and_a_missing_fact_matches_nothing():
    assert _match("kernel_driver", ["i915", "nvidia"], NVIDIA)
    assert not _match("kernel_driver", ["i915"], NVIDIA)
    assert not _match("vendor", ["0x10de"], PLATFORM)  # a PCI selector, a platform device
    assert not _match("class", ["0x12"], PLATFORM)
    assert not _match("model", ["H100"], INTEL)


def test_pci_addresses_full_or_as_lspci_prints_them():
    assert _match("pci_address", ["0000:3b:00.0"], NVIDIA)
    assert _match("pci_address", ["3b:00.0"], NVIDIA)
    assert not _match("pci_address", ["3b:00.1"], NVIDIA)


@pytest.mark.parametrize(("pattern", "nvidia", "intel"), [
    ("0x03", True, False), ("0x0302", True, False), ("0x030200", True, False),
    ("0x12", False, True), ("12", False, True), ("0x0300", False, False)])
def test_class_prefixes_of_two_four_or_six_hex_digits(pattern, nvidia, intel):
    assert _match("class", [pattern], NVIDIA) is nvidia
    assert _match("class", [pattern], INTEL) is intel


def test_integers_and_ranges_match_decimal_facts():
    assert _match("index", [3], NVIDIA)
    assert not _match("index", [4], NVIDIA)
    assert _match("index", ["0-3"], NVIDIA) and _match("index", ["5,7"], INTEL)
    assert not _match("index", ["0-2,4"], NVIDIA)
    assert _match("index", ["3"], NVIDIA)  # the exact string too
    assert not _match("model", [3], NVIDIA)  # a number never equals a name
    assert 6 in parse_ranges("0-3, 6") and 4 not in parse_ranges("0-3,6")


class ScanOnly(Driver):
    """What a driver needs when its facts are attributes: a name, subsystems and scan."""

    name = "scan-only"
    subsystems = ("pci",)
    selector_types = {"vendor": (str, int), "pci_address": (str,), "index": (int, str),
                      "model": (str,)}

    def __init__(self, devices: List[Device]) -> None:
        self.devices = devices

    def scan(self, host: HostFS) -> List[Device]:
        return self.devices


class Renamed(ScanOnly):
    """A key matched against another attribute, and one key with a meaning of its own."""

    selector_attributes = {"index": "slot"}

    def selector_test(self, key, values):
        if key == "model":
            wanted = {str(v).lower() for v in values}
            return lambda attributes: attributes.get("model", "").lower() in wanted
        return super().selector_test(key, values)


DEVICES = [Device("gpu0", attributes=NVIDIA), Device("npu0", attributes=INTEL),
           Device("npu1", attributes=PLATFORM)]


def _ids(driver: Driver, **selectors: object) -> List[str]:
    resource = ResourceConfig("example.com/x", driver.name, selectors)
    found = driver.discover(HostFS("/nonexistent"), [resource])
    return [device.id for device in found["example.com/x"]]


def test_a_driver_that_only_scans_gets_the_host_matching():
    driver = ScanOnly(DEVICES)
    assert _ids(driver) == ["gpu0", "npu0", "npu1"]  # no selectors: every device
    assert _ids(driver, vendor="0x8086") == ["npu0"]
    assert _ids(driver, vendor=["0x8086", 4318]) == ["gpu0", "npu0"]
    assert _ids(driver, vendor="0x8086", pci_address="3b:00.0") == []  # every selector holds
    assert _ids(driver, index="0-5") == ["gpu0"]
    driver.check_selectors({"vendor": "0x10de"})


def test_a_driver_overrides_only_the_keys_that_need_it():
    driver = Renamed([Device("a", attributes={**NVIDIA, "slot": "1"}),
                      Device("b", attributes={**INTEL, "slot": "2", "model": "npu"})])
    assert _ids(driver, index=2) == ["b"]  # matched against "slot", not "index"
    assert _ids(driver, model="h100") == ["a"]  # the driver's own rule: any case
    assert _ids(driver, model="NPU", vendor="0x8086") == ["b"]  # the host's rule for vendor
