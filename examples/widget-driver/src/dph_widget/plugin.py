"""Entry point of the widget driver (``device_plugin_host.drivers`` group, name ``widget``).

Only the hook lives here, so that importing the entry point stays cheap and cannot fail on
anything but a broken install.
"""

from __future__ import annotations

from typing import List

from device_plugin_host import Driver, hookimpl

from dph_widget.driver import WidgetDriver


@hookimpl
def device_plugin_host_drivers() -> List[Driver]:
    return [WidgetDriver()]
