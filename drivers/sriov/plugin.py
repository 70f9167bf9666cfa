"""Entry point ``drivers.sriov.plugin`` of the ``device_plugin_host.drivers`` group."""

from __future__ import annotations

from typing import List

from device_plugin_host import hookimpl
from drivers.sriov.driver import SriovDriver


@hookimpl
def device_plugin_host_drivers() -> List[SriovDriver]:
    return [SriovDriver()]
