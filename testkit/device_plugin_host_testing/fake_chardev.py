"""Class char devices for fake trees, in the shape drivers/base/core.c gives them.

``device_create(class, parent, devt, ..., name)`` puts the device at
``<parent's sysfs dir>/<class>/<name>`` (``/sys/devices/virtual/<class>/<name>`` when there is
no parent), with ``dev`` ("major:minor"), ``uevent`` (MAJOR, MINOR, DEVNAME), ``subsystem``
pointing at the class, ``device`` pointing at the parent; the class lists it in
``/sys/class/<class>/<name>`` and the kernel indexes it in ``/sys/dev/char/<major>:<minor>``
(``device_create_sys_dev_entry``). udev (or devtmpfs) creates ``/dev/<DEVNAME>``.
"""

from __future__ import annotations

from typing import Optional

from host.sim.tree import FakeTree


def add_class_chardev(
    tree: FakeTree,
    parent: Optional[str],
    klass: str,
    name: str,
    major: int,
    minor: int,
    *,
    devname: Optional[str] = None,
    devtype: Optional[str] = None,
    node: bool = True,
) -> str:
    """A class char device under ``parent`` (a /sys/devices path, or None for virtual/).
    ``devname`` is the uevent DEVNAME (default ``name``); ``node`` creates the /dev entry.
    Returns the device's sysfs path."""
    base = parent if parent is not None else "/sys/devices/virtual"
    path = f"{base}/{klass}/{name}"
    devname = devname or name
    tree.attr(f"{path}/dev", f"{major}:{minor}")
    lines = [f"MAJOR={major}", f"MINOR={minor}", f"DEVNAME={devname}"]
    if devtype:
        lines.append(f"DEVTYPE={devtype}")
    tree.attr(f"{path}/uevent", "\n".join(lines))
    tree.link(f"{path}/subsystem", f"/sys/class/{klass}")
    if parent is not None:
        tree.link(f"{path}/device", parent)
    tree.mkdir(f"{path}/power")
    tree.link(f"/sys/class/{klass}/{name}", path)
    tree.link(f"/sys/dev/char/{major}:{minor}", path)
    if node:
        tree.chardev(f"/dev/{devname}", major, minor)
    return path
