"""Intel QuickAssist (QAT) physical functions: what service a PF runs and whether it is alive.

A QAT VF can only do what its PF was configured for, so the PF's service is a selector: the
kernel's QAT driver (qat_common/adf_sysfs.c) shows it as ``<pf>/qat/cfg_services`` ("sym;asym",
"dc", "asym;dc", ...; the order of the parts is not fixed, "asym;sym" is the same pool), next to
``<pf>/qat/state`` ("up"/"down"; a PF that is down serves nothing, and the kernel only answers
``cfg_services`` sensibly while it is up, which is why Intel's plugin reads it only then).

Firmware health is the heartbeat (qat_common/adf_heartbeat_dbgfs.c): debugfs
``/sys/kernel/debug/qat_<class>_<pci address>/heartbeat/status`` reads "0" while the firmware
answers and "-1" once it stopped (Documentation/ABI/testing/debugfs-driver-qat). The kernel
copies the terminating NUL into the read (``len + 1``), so the text is "0\\n\\0". The directory
is named after the device class (``qat_4xxx_...`` for 4xxx/401xx/402xx), which is also the PF
driver's name. Debugfs is root-only and not always mounted: an unreadable heartbeat is
"unknown" and judged by nothing, never guessed healthy or unhealthy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import FrozenSet, Optional, Set

from device_plugin_host import HostFS, PciFunction

#: Service names the kernel accepts in cfg_services (adf_cfg_services.c) and "cy" as Intel's
#: plugin and qatlib call sym+asym.
SERVICES = frozenset({"sym", "asym", "dc", "dcc", "decomp"})
ALIASES = {"cy": ("sym", "asym")}

HEARTBEAT_OK = "ok"
HEARTBEAT_FAILED = "failed"
HEARTBEAT_UNKNOWN = "unknown"


@dataclass(frozen=True)
class QatPf:
    state: Optional[str]  # "up" / "down"; None when unreadable
    services: Optional[str]  # cfg_services as the kernel prints it; None when unreadable
    heartbeat: str  # ok / failed / unknown
    heartbeat_path: str
    service_set: Optional[FrozenSet[str]] = None  # ``services`` parsed

    def problem(self, pf_address: str) -> str:
        """Why the PF's VFs cannot be used now; empty when they can (or nothing is known)."""
        if self.state == "down":
            return f"QAT PF {pf_address} is down (qat/state)"
        if self.heartbeat == HEARTBEAT_FAILED:
            return (f"QAT PF {pf_address} firmware heartbeat failed "
                    f"({self.heartbeat_path} reads -1)")
        return ""


def parse_services(text: str) -> FrozenSet[str]:
    """"sym;asym" -> {sym, asym}; raises ValueError naming an unknown service."""
    out: Set[str] = set()
    for part in text.replace(",", ";").split(";"):
        name = part.strip().lower()
        if not name:
            continue
        if name in ALIASES:
            out.update(ALIASES[name])
        elif name in SERVICES:
            out.add(name)
        else:
            known = ", ".join(sorted(SERVICES | set(ALIASES)))
            raise ValueError(f"{part.strip()!r} is not a QAT service ({known})")
    if not out:
        raise ValueError(f"{text!r} names no QAT service")
    return frozenset(out)


def heartbeat_path(pf: PciFunction) -> str:
    return f"/sys/kernel/debug/qat_{pf.kernel_driver}_{pf.address}/heartbeat/status"


def read_qat(host: HostFS, pf: PciFunction) -> Optional[QatPf]:
    """The QAT facts of a PF, or None when it is no QAT PF (no ``qat/`` group in sysfs)."""
    if not host.is_dir(f"{pf.path}/qat"):
        return None
    state = host.read(f"{pf.path}/qat/state") or None
    services = host.read(f"{pf.path}/qat/cfg_services") or None
    service_set = None
    if services is not None:
        try:
            service_set = parse_services(services)
        except ValueError:
            services = None  # a value this code does not know selects nothing
    path = heartbeat_path(pf)
    raw = host.read(path) if pf.kernel_driver else None
    heartbeat = HEARTBEAT_UNKNOWN
    if raw is not None:
        first = raw.replace("\x00", "").strip().split("\n")[0].strip()
        if first == "0":
            heartbeat = HEARTBEAT_OK
        elif first == "-1":
            heartbeat = HEARTBEAT_FAILED
    return QatPf(state=state, services=services, heartbeat=heartbeat, heartbeat_path=path,
                 service_set=service_set)
