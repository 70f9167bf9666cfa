"""The host's selector matching (host/core/selectors.py) as plain functions over attribute dicts:
no driver, no tree, no config file. Drivers' own tests show the same rules on fake sysfs."""

from __future__ import annotations

import pytest

from host.core.selectors import all_of, attribute_test, class_pattern, hex_id, parse_ranges


def matches(key, values, attributes, attribute=None) -> bool:
    return attribute_test(key, values, attribute)(attributes)


@pytest.mark.parametrize("value", ["0x10de", "0x10DE", "10de", "0x000010de", 4318])
def test_hex_ids_match_in_any_case_width_prefix_or_as_integers(value):
    assert matches("vendor", [value], {"vendor": "0x10de"})
    assert not matches("vendor", [value], {"vendor": "0x1002"})


def test_a_list_is_any_of_its_values_and_a_missing_fact_matches_nothing():
    assert matches("device", ["0x20b0", "0x2330"], {"device": "0x2330"})
    assert not matches("device", ["0x20b0"], {})
    assert not matches("kernel_driver", ["nvidia"], {})


def test_pci_address_full_or_lspci_short_form():
    attrs = {"pci_address": "0000:3b:00.0"}
    assert matches("pci_address", ["0000:3b:00.0"], attrs)
    assert matches("pci_address", ["3b:00.0"], attrs)
    assert not matches("pci_address", ["3b:00.1"], attrs)


def test_class_prefixes_of_two_four_or_six_hex_digits():
    attrs = {"class": "0x030200"}  # 3D controller
    for prefix in ("0x03", "0302", "0x030200"):
        assert matches("class", [prefix], attrs), prefix
    assert not matches("class", ["0x0300"], attrs)
    assert class_pattern("0x3") is None and class_pattern("zz") is None


def test_other_keys_exact_string_integer_as_decimal_and_ranges():
    assert matches("kernel_driver", ["vfio-pci"], {"kernel_driver": "vfio-pci"})
    assert not matches("kernel_driver", ["vfio"], {"kernel_driver": "vfio-pci"})
    assert matches("index", [3], {"index": "3"})
    assert not matches("index", [3], {"index": "03x"})
    assert matches("vf", ["0-3,6"], {"vf": "6"}) and matches("vf", ["0-3,6"], {"vf": "2"})
    assert not matches("vf", ["0-3,6"], {"vf": "5"})


def test_a_selector_can_read_another_attribute():
    assert matches("model", ["A100"], {"product": "A100"}, attribute="product")


def test_ranges_parse_or_say_what_is_wrong():
    spans = parse_ranges("0-3, 6")
    assert 0 in spans and 3 in spans and 6 in spans and 4 not in spans and "1" not in spans
    for bad, why in [("3-1", "ends before"), ("1,,2", "empty"), ("a-2", "not a VF index")]:
        with pytest.raises(ValueError, match=why):
            parse_ranges(bad)


def test_hex_id_refuses_booleans_and_text_that_is_not_hex():
    assert hex_id(True) is None and hex_id("0xg1") is None and hex_id("") is None
    assert hex_id(" 0x1DA3 ") == 0x1DA3


def test_every_selector_must_hold_and_none_match_everything():
    vendor = attribute_test("vendor", ["0x10de"])
    driver = attribute_test("kernel_driver", ["nvidia"])
    both = all_of([vendor, driver])
    assert both({"vendor": "0x10de", "kernel_driver": "nvidia"})
    assert not both({"vendor": "0x10de", "kernel_driver": "vfio-pci"})
    assert all_of([])({})
