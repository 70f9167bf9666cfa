"""``version = 1`` and ``[host] disabled_drivers``: accepted, optional, checked."""

from __future__ import annotations

import pytest

from device_plugin_host_testing.drivers import MemoryDriver
from host.config import CONFIG_VERSION, ConfigError, parse_config

DRIVERS = {"m": MemoryDriver("m"), "other": MemoryDriver("other")}
RESOURCE = '[[resource]]\nname = "example.com/a"\ndriver = "m"\n'


def test_version_one_is_accepted_and_optional():
    assert CONFIG_VERSION == 1
    with_version = parse_config("version = 1\n" + RESOURCE, "f.toml", DRIVERS)
    without = parse_config(RESOURCE, "f.toml", DRIVERS)
    assert with_version == without


@pytest.mark.parametrize("value", ["2", "0", "1.0", '"1"', "true", "[1]"])
def test_any_other_version_is_one_line_naming_the_key(value):
    with pytest.raises(ConfigError) as caught:
        parse_config(f"version = {value}\n" + RESOURCE, "f.toml", DRIVERS)
    assert caught.value.file == "f.toml" and caught.value.key == "version"
    assert str(caught.value).startswith("f.toml: version: must be 1")
    assert "\n" not in str(caught.value)


def test_disabled_drivers_are_parsed_and_checked():
    config = parse_config('[host]\ndisabled_drivers = ["other", "not-installed"]\n' + RESOURCE,
                          "f.toml", DRIVERS)
    assert config.host.disabled_drivers == ("other", "not-installed")
    assert parse_config(RESOURCE, "f.toml", DRIVERS).host.disabled_drivers == ()
    for value, key, reason in (
        ('"other"', "host.disabled_drivers", "must be an array of driver names"),
        ("[1]", "host.disabled_drivers[0]", "must be a driver name (a string)"),
        ('["a b"]', "host.disabled_drivers[0]", "is not a driver name"),
        ('[""]', "host.disabled_drivers[0]", "is not a driver name"),
        ('["m2", "m2"]', "host.disabled_drivers[1]", "is listed twice"),
    ):
        with pytest.raises(ConfigError) as caught:
            parse_config(f"[host]\ndisabled_drivers = {value}\n" + RESOURCE, "f.toml", DRIVERS)
        assert caught.value.key == key, value
        assert reason in caught.value.reason, value


def test_a_resource_of_a_disabled_driver_is_a_config_error():
    with pytest.raises(ConfigError) as caught:
        parse_config('[host]\ndisabled_drivers = ["m"]\n' + RESOURCE, "f.toml", DRIVERS)
    assert caught.value.key == "resource[0] (example.com/a).driver"
    assert "disabled by host.disabled_drivers" in caught.value.reason


def test_disabled_drivers_serve_no_built_in_defaults():
    class WithDefaults(MemoryDriver):
        def default_resources(self):
            from host.core.model import ResourceConfig

            return [ResourceConfig(f"example.com/{self.name}", self.name)]

    drivers = {"m": WithDefaults("m"), "other": WithDefaults("other")}
    served = parse_config("", "f.toml", drivers)
    assert [r.name for r in served.resources] == ["example.com/m", "example.com/other"]
    config = parse_config('[host]\ndisabled_drivers = ["other"]\n', "f.toml", drivers)
    assert config.is_default and [r.name for r in config.resources] == ["example.com/m"]
