"""The hook surface for hardware drivers: the public API for third-party driver packages.

A driver package is a module (or object) registered under the ``device_plugin_host.drivers``
entry-point group. It implements one hook, :func:`device_plugin_host_drivers`, which returns
driver objects. Everything else a driver does lives on those objects (see
:class:`device_plugin_host.Driver`): a name, the udev subsystems it watches, a side-effect-free
``discover`` and optional ``allocate`` / ``preferred`` / ``pre_start`` / ``check_selectors`` /
``default_resources``. The host calls each implementation on its own, so a failing package is
attributed and isolated; it never broadcasts a hook call across packages.

Example (a complete package)::

    # my_driver/__init__.py
    from device_plugin_host import Driver, hookimpl

    class Widget(Driver):
        name = "widget"
        subsystems = ("usb",)
        def scan(self, host): ...
        def select(self, inventory, resource): ...

    @hookimpl
    def device_plugin_host_drivers():
        return [Widget()]

    # pyproject.toml
    [project.entry-points."device_plugin_host.drivers"]
    widget = "my_driver"
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import pluggy

if TYPE_CHECKING:
    from host.core.driver import Driver

PROJECT = "device_plugin_host"
ENTRY_POINT_GROUP = "device_plugin_host.drivers"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def device_plugin_host_drivers() -> Sequence[Driver]:
    """Return the driver objects this package provides.

    Called once per package at start-up, on its own, so an exception here disables only this
    package (logged with its distribution name and version). Each driver's ``name`` must be
    unique across all installed packages: config files select a driver by that name. Return
    fresh objects; the host owns them for the life of the process. Must not do I/O.
    """
    raise NotImplementedError  # pragma: no cover - specification only
