"""AMD/Xilinx XRT cards (Alveo U200/U250/U280/U50/U55C, VCK5000, ...), read once.

An XRT card is two physical functions on one PCI slot. Since XRT 2018.3 the management PF is
function 0, bound to ``xclmgmt``, and the user PF is function 1, bound to ``xocl``; each driver
leaves a marker file (``mgmt_pf`` / ``user_pf``), which is how the Xilinx FPGA device plugin
tells them apart (older shells had the two swapped, so the function number alone is not
trusted). A container needs the user PF's DRM render node (/dev/dri/renderD*, found under
``<user>/drm``) and the management node /dev/xclmgmt<instance>, where xclmgmt names the node
with XOCL_DEV_ID: ``domain << 16 | bus << 8 | slot << 3 | function`` (so 0000:d8:00.0 is
/dev/xclmgmt55296). That number is taken, in order, from the node's class directory
``<mgmt>/xrt_mgmt/xclmgmt*``, the ``instance`` attribute, or the formula.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from device_plugin_host import HostFS, PciFunction, is_pci_address
from drivers.fpga.dfl import FpgaNode

log = logging.getLogger(__name__)

USER_DRIVERS = frozenset({"xocl"})
MGMT_DRIVERS = frozenset({"xclmgmt"})


@dataclass(frozen=True)
class XrtCard:
    user: PciFunction
    mgmt: Optional[PciFunction]
    render_node: Optional[FpgaNode]
    mgmt_node: Optional[FpgaNode]
    shell: Optional[str]
    shell_timestamp: Optional[str]
    serial: Optional[str]
    problems: Tuple[str, ...] = ()


def xrt_instance(address: str) -> Optional[int]:
    """XRT's XOCL_DEV_ID for a PCI address; None for a malformed one."""
    if not is_pci_address(address):
        return None
    domain, bus, rest = address.split(":")
    slot, func = rest.split(".")
    return (int(domain, 16) << 16) | (int(bus, 16) << 8) | (int(slot, 16) << 3) | int(func, 16)


def _role(host: HostFS, function: PciFunction) -> Optional[str]:
    if host.exists(f"{function.path}/user_pf"):
        return "user"
    if host.exists(f"{function.path}/mgmt_pf"):
        return "mgmt"
    if function.kernel_driver in USER_DRIVERS:
        return "user"
    if function.kernel_driver in MGMT_DRIVERS:
        return "mgmt"
    return None


def scan_xrt(host: HostFS, functions: Sequence[PciFunction]) -> List[XrtCard]:
    slots: Dict[str, Dict[str, List[PciFunction]]] = {}
    for function in functions:
        role = _role(host, function)
        if role is not None:
            slot = function.address.rsplit(".", 1)[0]
            slots.setdefault(slot, {"user": [], "mgmt": []})[role].append(function)
    cards = []
    for slot in sorted(slots):
        users, mgmts = slots[slot]["user"], slots[slot]["mgmt"]
        mgmt = mgmts[0] if mgmts else None
        problems: List[str] = []
        if not users:
            user = _unbound_user(functions, slot, mgmt)
            if user is None:
                continue
            problems.append(
                f"user function {user.address} is not bound to xocl "
                f"(driver: {user.kernel_driver or 'none'})"
            )
            users = [user]
        if len(users) > 1 or len(mgmts) > 1:
            log.warning(
                "xrt slot %s: %d user and %d management functions; pairing the first",
                slot,
                len(users),
                len(mgmts),
            )
        cards.append(_read_card(host, users[0], mgmt, problems))
    return cards


def _unbound_user(
    functions: Sequence[PciFunction], slot: str, mgmt: Optional[PciFunction]
) -> Optional[PciFunction]:
    """The user PF of a card whose xocl is not loaded (a common install slip): report the card
    Unhealthy rather than hide it. A sibling bound to another driver (vfio-pci: passed to a VM)
    is not ours, and a card with no sibling at all is mgmt-only on this host."""
    siblings = [
        f for f in functions if f.address.rsplit(".", 1)[0] == slot and (mgmt is None or f != mgmt)
    ]
    if not siblings:
        log.info("xrt slot %s: management function only, no user function visible; skipped", slot)
        return None
    sibling = siblings[0]
    if sibling.kernel_driver is not None:
        log.info(
            "xrt slot %s: user function %s is bound to %s, not xocl; skipped",
            slot,
            sibling.address,
            sibling.kernel_driver,
        )
        return None
    return sibling


def _devname(host: HostFS, sys_path: str) -> Optional[str]:
    for line in (host.read(f"{sys_path}/uevent") or "").splitlines():
        key, _, value = line.partition("=")
        value = value.strip()
        if key == "DEVNAME" and value and not value.startswith("/") and ".." not in value:
            return value
    return None


def _render_node(host: HostFS, user: PciFunction) -> Optional[FpgaNode]:
    names = [n for n in host.listdir(f"{user.path}/drm") if n.startswith("renderD")]
    if not names:
        return None
    name = sorted(names, key=lambda n: (len(n), n))[0]
    dev_path = "/dev/" + (_devname(host, f"{user.path}/drm/{name}") or f"dri/{name}")
    return FpgaNode(name, dev_path, host.exists(dev_path))


def _mgmt_node(host: HostFS, mgmt: PciFunction) -> Optional[FpgaNode]:
    names = [n for n in host.listdir(f"{mgmt.path}/xrt_mgmt") if n.startswith("xclmgmt")]
    if names:
        name = names[0]
        dev_path = "/dev/" + (_devname(host, f"{mgmt.path}/xrt_mgmt/{name}") or name)
        return FpgaNode(name, dev_path, host.exists(dev_path))
    instance = host.read_int(f"{mgmt.path}/instance", 10)
    if instance is None or instance < 0:
        instance = xrt_instance(mgmt.address)
    if instance is None:
        return None
    name = f"xclmgmt{instance}"
    return FpgaNode(name, f"/dev/{name}", host.exists(f"/dev/{name}"))


def _subdevice_attr(
    host: HostFS, functions: Sequence[Optional[PciFunction]], prefix: str, attr: str
) -> Optional[str]:
    """An attribute of an XRT subdevice directory (rom.u.N/VBNV, xmc.m.N/serial_num). Only
    directories count: a PCI function also has a plain ``rom`` file (its expansion ROM)."""
    for function in functions:
        if function is None:
            continue
        for child in host.listdir(function.path):
            if child.startswith(prefix) and host.is_dir(f"{function.path}/{child}"):
                value = host.read(f"{function.path}/{child}/{attr}")
                if value:
                    return value
    return None


def _read_card(
    host: HostFS, user: PciFunction, mgmt: Optional[PciFunction], problems: List[str]
) -> XrtCard:
    render = _render_node(host, user)
    if render is None and not problems:
        problems.append(f"no DRM render node under {user.address}/drm (xocl not ready?)")
    elif render is not None and not render.present:
        problems.append(f"device node {render.dev_path} missing")
    mgmt_node = _mgmt_node(host, mgmt) if mgmt is not None else None
    if mgmt_node is not None and not mgmt_node.present:
        problems.append(f"device node {mgmt_node.dev_path} missing")
    return XrtCard(
        user=user,
        mgmt=mgmt,
        render_node=render,
        mgmt_node=mgmt_node,
        shell=_subdevice_attr(host, (user, mgmt), "rom.", "VBNV"),
        shell_timestamp=_subdevice_attr(host, (user, mgmt), "rom.", "timestamp"),
        serial=_subdevice_attr(host, (mgmt, user), "xmc.", "serial_num"),
        problems=tuple(problems),
    )
