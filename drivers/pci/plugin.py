"""Entry point of the built-in generic pci driver (``device_plugin_host.drivers`` group)."""

from __future__ import annotations

from typing import List

from device_plugin_host import Driver, hookimpl
from drivers.pci.driver import PciDriver


@hookimpl
def device_plugin_host_drivers() -> List[Driver]:
    return [PciDriver()]
