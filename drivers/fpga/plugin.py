"""Entry point of the built-in FPGA driver (``device_plugin_host.drivers`` group)."""

from __future__ import annotations

from typing import List

from device_plugin_host import Driver, hookimpl
from drivers.fpga.driver import FpgaDriver


@hookimpl
def device_plugin_host_drivers() -> List[Driver]:
    return [FpgaDriver()]
