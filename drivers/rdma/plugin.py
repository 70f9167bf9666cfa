"""Entry point ``drivers.rdma.plugin`` of the ``device_plugin_host.drivers`` group."""

from __future__ import annotations

from typing import List

from device_plugin_host import hookimpl
from drivers.rdma.driver import RdmaDriver


@hookimpl
def device_plugin_host_drivers() -> List[RdmaDriver]:
    return [RdmaDriver()]
