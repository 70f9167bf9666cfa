"""Entry point of the built-in accel driver (``device_plugin_host.drivers`` group)."""

from __future__ import annotations

from typing import List

from drivers.accel.driver import AccelDriver
from host.driver import Driver
from host.hookspecs import hookimpl


@hookimpl
def device_plugin_host_drivers() -> List[Driver]:
    return [AccelDriver()]
