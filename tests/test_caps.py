"""The documented limits (README "Limits"): 256 resources in a file, 100,000 advertised
devices on a host; past them, one clear line, never a stalled host."""

from __future__ import annotations

import logging

import pytest

from device_plugin_host_testing.drivers import MemoryDriver, make_devices
from host.config import MAX_RESOURCES, ConfigError, parse_config
from host.config.plugins import load_drivers
from host.core.hostfs import HostFS
from host.core.isolation import DriverCalls
from host.core.model import ResourceConfig
from host.inventory import MAX_DEVICES, Inventory
from host.sim.tree import FakeTree


def _resources(count: int) -> str:
    return "".join(f'[[resource]]\nname = "example.com/r{i}"\ndriver = "usb"\n'
                   for i in range(count))


def test_more_resources_than_the_cap_is_a_config_error():
    drivers = load_drivers().with_unavailable()
    assert MAX_RESOURCES == 256
    assert len(parse_config(_resources(256), "c.toml", drivers).resources) == 256
    with pytest.raises(ConfigError) as caught:
        parse_config(_resources(10_000), "c.toml", drivers)
    assert str(caught.value).startswith("c.toml: resource: 10000 resources; at most 256 ")


def test_devices_past_the_host_cap_are_not_advertised_and_said_once(tmp_path, run, caplog):
    FakeTree(tmp_path).numa_nodes(1)
    assert MAX_DEVICES == 100_000
    # 98 cards shared 1024 ways, plus 1,000 devices of another resource: 101,352 in all.
    driver = MemoryDriver("m", {"example.com/shared": make_devices("g", 98),
                                "example.com/other": make_devices("o", 1000)})
    resources = [ResourceConfig("example.com/other", "m"),
                 ResourceConfig("example.com/shared", "m", replicas=1024)]
    calls = DriverCalls()
    inventory = Inventory(HostFS(str(tmp_path)), {"m": driver}, resources, calls,
                          discover_timeout_s=30, vanished_grace_s=0)

    async def scenario():
        with caplog.at_level(logging.ERROR, logger="host.inventory"):
            await inventory.scan()
            await inventory.scan()
        counts = {name: len(devices) for name, devices in inventory.devices.items()}
        assert sum(counts.values()) == MAX_DEVICES
        assert counts["example.com/other"] == 1000
        lines = [r.getMessage() for r in caplog.records if "limit" in r.getMessage()]
        assert len(lines) == 1, lines
        assert "example.com/shared" in lines[0] and "1352 are not advertised" in lines[0]

    try:
        run(scenario())
    finally:
        calls.shutdown()
