"""The FPGA driver: Intel DFL ports and AMD/Xilinx XRT (Alveo) cards.

DFL cards are served like the Intel FPGA plugin serves them: by default one device per
accelerator port (mode "af"), or one per card's base region with all its ports (mode
"region", plus the FME node in "regiondevel" for pods that program the card themselves). The
accelerator and interface ids are attributes and selectors, so a config can name one resource
per loaded AFU the way the Intel plugin's ``af-*`` / ``region-*`` resources do. XRT cards are
one device per card: the user PF's render node and the management node together.

An optional ``pre_start`` program runs before each container start; only resources that set
it advertise PreStartContainer, so the others add no latency to pod starts.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from dataclasses import dataclass, replace
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from device_plugin_host import (
    PCI_SELECTOR_TYPES,
    Device,
    DeviceNode,
    Driver,
    Health,
    HostFS,
    PciFunction,
    ResourceConfig,
    SelectorError,
    check_pci_selectors,
    list_functions,
    matches_pci,
    selector_values,
)
from drivers.fpga.dfl import ALL_ONES, DflRegion, normalise_uuid, scan_dfl
from drivers.fpga.prestart import run_program
from drivers.fpga.xrt import XrtCard, scan_xrt

log = logging.getLogger(__name__)

#: Accepted ``kind`` values; "alveo" is another name for "xrt".
KINDS: Mapping[str, str] = {"dfl": "dfl", "xrt": "xrt", "alveo": "xrt"}
MODES = ("af", "region", "regiondevel")
DEFAULT_PRE_START_TIMEOUT_S = 20.0
#: The kubelet abandons PreStartContainer after 30 s and the host's own bound is 28 s; the
#: program must finish (or be killed and reported) well inside that.
MAX_PRE_START_TIMEOUT_S = 25.0
_PCI_KEYS = tuple(PCI_SELECTOR_TYPES)
_DFL_ONLY = ("afu_id", "interface_id")
_XRT_ONLY = ("shell",)


@dataclass(frozen=True)
class FpgaInventory:
    regions: Tuple[DflRegion, ...]
    cards: Tuple[XrtCard, ...]


class FpgaDriver(Driver):
    name = "fpga"
    # dfl-fme.N / dfl-port.N are platform devices (their /dev nodes come with "platform"
    # events); an XRT card's render node comes with "drm" and its xclmgmt node with the
    # "xrt_mgmt" class: without them a card would wait for the timed rescan after a reload.
    subsystems = ("dfl", "pci", "fpga_region", "platform", "drm", "xrt_mgmt")
    device_globs = ("/dev/dfl-*", "/dev/xclmgmt*", "/dev/dri/*")
    selector_types = {
        **PCI_SELECTOR_TYPES,
        "kind": (str,),
        "afu_id": (str,),
        "interface_id": (str,),
        "shell": (str,),
    }
    setting_types = {
        "mode": (str,),
        "pre_start": (list,),
        "pre_start_timeout_s": (int, float),
    }

    # -- configuration -----------------------------------------------------------------
    def check_selectors(self, selectors: Mapping[str, object]) -> None:
        super().check_selectors(selectors)
        check_pci_selectors(selectors)
        kinds = {KINDS.get(str(k)) for k in selector_values(selectors, "kind") or ()}
        if None in kinds:
            raise SelectorError("kind", f"must be one of {', '.join(KINDS)}")
        for key in _DFL_ONLY:
            for value in selector_values(selectors, key) or ():
                if normalise_uuid(str(value)) is None:
                    raise SelectorError(key, "must be 32 hex digits (a UUID, dashes allowed)")
        if kinds == {"xrt"}:
            for key in _DFL_ONLY:
                if key in selectors:
                    raise SelectorError(key, 'applies to kind "dfl" only')
        if kinds == {"dfl"} and "shell" in selectors:
            raise SelectorError("shell", 'applies to kind "xrt" only')

    def check_settings(self, settings: Mapping[str, object]) -> None:
        super().check_settings(settings)
        mode = settings.get("mode")
        if mode is not None and mode not in MODES:
            raise SelectorError("mode", f"must be one of {', '.join(MODES)}")
        argv = settings.get("pre_start")
        if argv is not None:
            if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
                raise SelectorError("pre_start", "must be a non-empty list of strings (argv)")
            if any("\x00" in a for a in argv):
                raise SelectorError("pre_start", "arguments must not contain NUL")
            program = argv[0]
            if not program.startswith("/") or ".." in program.split("/"):
                raise SelectorError(
                    "pre_start", f"the program must be an absolute path, got {program!r}"
                )
        timeout = settings.get("pre_start_timeout_s")
        if timeout is not None:
            if not isinstance(timeout, (int, float)) or not 0 < timeout <= MAX_PRE_START_TIMEOUT_S:
                raise SelectorError(
                    "pre_start_timeout_s",
                    f"must be above 0 and at most {MAX_PRE_START_TIMEOUT_S:g} (the kubelet "
                    "gives PreStartContainer 30 s)",
                )
            if argv is None:
                raise SelectorError("pre_start_timeout_s", "set without pre_start")

    def default_resources(self) -> Sequence[ResourceConfig]:
        """One resource per card family, each registered once such a card is present.

        Resource names cannot depend on what is loaded (defaults are fixed before discovery),
        so unlike the Intel plugin's per-AFU names the DFL default is one name for every port;
        a config with ``afu_id`` / ``interface_id`` selectors names one resource per AFU.
        """
        return (
            ResourceConfig(
                "fpga.intel.com/dfl-port",
                self.name,
                selectors={"kind": "dfl"},
                register_when_empty=False,
            ),
            ResourceConfig(
                "amd.com/alveo", self.name, selectors={"kind": "xrt"}, register_when_empty=False
            ),
        )

    # -- discovery -----------------------------------------------------------------------
    def scan(self, host: HostFS) -> FpgaInventory:
        valid_numa = host.machine_numa_nodes()
        regions = scan_dfl(host, valid_numa)
        cards = scan_xrt(host, list_functions(host))
        return FpgaInventory(tuple(regions), tuple(cards))

    def select(self, inventory: FpgaInventory, resource: ResourceConfig) -> List[Device]:
        selectors = resource.selectors
        kinds = {KINDS[str(k)] for k in selector_values(selectors, "kind") or KINDS}
        mode = str(resource.settings.get("mode", "af"))
        env_key = pci_env_name(resource.name)
        out: List[Device] = []
        if "dfl" in kinds and "shell" not in selectors:
            if mode == "af":
                out.extend(_port_devices(inventory.regions, selectors, env_key))
            else:
                out.extend(
                    _region_devices(
                        inventory.regions, selectors, env_key, with_fme=mode == "regiondevel"
                    )
                )
        if "xrt" in kinds and not any(key in selectors for key in _DFL_ONLY):
            out.extend(
                _xrt_device(card, env_key)
                for card in inventory.cards
                if _matches_xrt(card, selectors)
            )
        return _unique(out, resource.name)

    # -- pre-start -------------------------------------------------------------------------
    def needs_pre_start(self, resource: ResourceConfig) -> bool:
        """Only a resource with a ``pre_start`` program asks the kubelet for PreStartContainer:
        the kubelet waits for that RPC on every container start."""
        return bool(resource.settings.get("pre_start"))

    def pre_start(self, resource: ResourceConfig, devices: Sequence[Device]) -> None:
        """Run the resource's program for the devices a container is about to start with.

        The program gets the devices in the environment: FPGA_RESOURCE, FPGA_DEVICE_IDS,
        FPGA_PCI_ADDRESSES, FPGA_DEVICE_NODES, and for DFL ports FPGA_AFU_IDS and
        FPGA_INTERFACE_IDS (each a comma-separated list in request order).
        """
        argv = resource.settings.get("pre_start")
        if not isinstance(argv, list) or not argv or not devices:
            return
        setting = resource.settings.get("pre_start_timeout_s", DEFAULT_PRE_START_TIMEOUT_S)
        timeout = (
            float(setting) if isinstance(setting, (int, float)) else DEFAULT_PRE_START_TIMEOUT_S
        )
        ids = [d.id for d in devices]
        what = f"resource {resource.name} devices {', '.join(ids)}"
        run_program([str(a) for a in argv], pre_start_env(resource.name, devices), timeout, what)


def pre_start_env(resource_name: str, devices: Sequence[Device]) -> Dict[str, str]:
    def joined(values: Sequence[Optional[str]]) -> str:
        seen: List[str] = []
        for value in values:
            for part in (value or "").split(","):
                if part and part not in seen:
                    seen.append(part)
        return ",".join(seen)

    env = {
        "FPGA_RESOURCE": resource_name,
        "FPGA_DEVICE_IDS": ",".join(d.id for d in devices),
        "FPGA_PCI_ADDRESSES": joined([d.attributes.get("pci_address") for d in devices]),
        "FPGA_DEVICE_NODES": joined([n.host_path for d in devices for n in d.device_nodes]),
    }
    afu = joined([d.attributes.get("afu_id") or d.attributes.get("afu_ids") for d in devices])
    interface = joined([d.attributes.get("interface_id") for d in devices])
    if afu:
        env["FPGA_AFU_IDS"] = afu
    if interface:
        env["FPGA_INTERFACE_IDS"] = interface
    return env


def pci_env_name(resource_name: str) -> str:
    """PCIDEVICE_<RESOURCE>, the SR-IOV device plugin's variable for allocated PCI addresses
    (``fpga.intel.com/dfl-port`` -> PCIDEVICE_FPGA_INTEL_COM_DFL_PORT)."""
    return "PCIDEVICE_" + re.sub(r"[^A-Z0-9]", "_", resource_name.upper())


# -- DFL -----------------------------------------------------------------------------------
def _matches_function(function: Optional[PciFunction], selectors: Mapping[str, object]) -> bool:
    if function is None:
        return not any(key in selectors for key in _PCI_KEYS)
    return matches_pci(function, selectors)


def _wanted(selectors: Mapping[str, object], key: str) -> Optional[set]:
    values = selector_values(selectors, key)
    return None if values is None else {normalise_uuid(str(v)) for v in values}


def _region_attributes(region: DflRegion) -> Dict[str, str]:
    out: Dict[str, str] = {"kind": "dfl", "region": region.name}
    if region.stack != "dfl":
        out["stack"] = region.stack
    if region.function is not None:
        out.update(region.function.attributes())
    if region.fme is not None:
        out["fme"] = region.fme.name
        if region.fme.bitstream_id:
            out["bitstream_id"] = region.fme.bitstream_id
    if region.interface_id:
        out["interface_id"] = region.interface_id
    if region.pf_address:
        out["pf_address"] = region.pf_address
    if region.feature_ids:
        out["dfl_feature_ids"] = ",".join(region.feature_ids)
    return out


def _region_problems(region: DflRegion) -> List[str]:
    if region.interface_id == ALL_ONES:
        return ["interface id reads all ones (FPGA firmware crashed?)"]
    return []


def _health(problems: Sequence[str], what: str) -> Tuple[Health, str]:
    if not problems:
        return Health.HEALTHY, ""
    reason = "; ".join(problems)
    log.warning("fpga %s: unhealthy: %s", what, reason)
    return Health.UNHEALTHY, reason


def _port_devices(
    regions: Sequence[DflRegion], selectors: Mapping[str, object], env_key: str
) -> List[Device]:
    afu_ids = _wanted(selectors, "afu_id")
    interface_ids = _wanted(selectors, "interface_id")
    out = []
    for region in regions:
        if not _matches_function(region.function, selectors):
            continue
        if interface_ids is not None and region.interface_id not in interface_ids:
            continue
        for index, port in enumerate(region.ports):
            if afu_ids is not None and port.afu_id not in afu_ids:
                continue
            problems = _region_problems(region)
            if not port.node.present:
                problems.append(f"device node {port.node.dev_path} missing")
            if port.afu_id == ALL_ONES:
                problems.append("AFU id reads all ones (FPGA firmware crashed?)")
            health, reason = _health(problems, port.name)
            number = port.port_id if port.port_id is not None else index
            device_id = f"{region.address}-port{number}" if region.address else port.name
            attributes = _region_attributes(region)
            attributes.update({"port": port.name, "port_node": port.node.dev_path})
            if port.port_id is not None:
                attributes["port_id"] = str(port.port_id)
            if port.afu_id:
                attributes["afu_id"] = port.afu_id
            out.append(
                Device(
                    id=device_id,
                    health=health,
                    health_reason=reason,
                    numa_nodes=region.numa_nodes,
                    device_nodes=(DeviceNode(port.node.dev_path),),
                    env={env_key: region.address} if region.address else {},
                    attributes=attributes,
                )
            )
    return out


def _region_devices(
    regions: Sequence[DflRegion], selectors: Mapping[str, object], env_key: str, with_fme: bool
) -> List[Device]:
    afu_ids = _wanted(selectors, "afu_id")
    interface_ids = _wanted(selectors, "interface_id")
    out = []
    for region in regions:
        if not region.ports or not _matches_function(region.function, selectors):
            continue
        if interface_ids is not None and region.interface_id not in interface_ids:
            continue
        if afu_ids is not None and not any(p.afu_id in afu_ids for p in region.ports):
            continue
        problems = _region_problems(region)
        nodes = [p.node for p in region.ports]
        if with_fme:
            if region.fme is None:
                problems.append("no FME found to program this region with")
            else:
                nodes.append(region.fme.node)
        missing = [n.dev_path for n in nodes if not n.present]
        if missing:
            problems.append("device node " + ", ".join(missing) + " missing")
        health, reason = _health(problems, region.name)
        attributes = _region_attributes(region)
        attributes["ports"] = ",".join(p.name for p in region.ports)
        afus = ",".join(p.afu_id or "" for p in region.ports)
        if afus.strip(","):
            attributes["afu_ids"] = afus
        out.append(
            Device(
                id=region.address or region.name,
                health=health,
                health_reason=reason,
                numa_nodes=region.numa_nodes,
                device_nodes=tuple(DeviceNode(n.dev_path) for n in nodes),
                env={env_key: region.address} if region.address else {},
                attributes=attributes,
            )
        )
    return out


# -- XRT -------------------------------------------------------------------------------------
def _matches_xrt(card: XrtCard, selectors: Mapping[str, object]) -> bool:
    """PCI selectors match when one function of the card (user or management) satisfies them
    all: ``device = "0x5005"`` with ``kernel_driver = "xocl"`` names the user PF,
    ``device = "0x5004"`` the same card by its management PF."""
    if not any(matches_pci(f, selectors) for f in (card.user, card.mgmt) if f is not None):
        return False
    shells = selector_values(selectors, "shell")
    return shells is None or card.shell in [str(s) for s in shells]


def _xrt_device(card: XrtCard, env_key: str) -> Device:
    nodes = []
    if card.render_node is not None:
        nodes.append(DeviceNode(card.render_node.dev_path))
    if card.mgmt_node is not None:
        nodes.append(DeviceNode(card.mgmt_node.dev_path))
    health, reason = _health(card.problems, card.user.address)
    attributes = {"kind": "xrt", **card.user.attributes()}
    optional = {
        "mgmt_address": card.mgmt.address if card.mgmt else None,
        "mgmt_device": f"0x{card.mgmt.device:04x}" if card.mgmt and card.mgmt.device else None,
        "render_node": card.render_node.dev_path if card.render_node else None,
        "mgmt_node": card.mgmt_node.dev_path if card.mgmt_node else None,
        "shell": card.shell,
        "shell_timestamp": card.shell_timestamp,
        "serial": card.serial,
    }
    attributes.update({k: v for k, v in optional.items() if v})
    return Device(
        id=card.user.address,
        health=health,
        health_reason=reason,
        numa_nodes=card.user.numa_nodes,
        device_nodes=tuple(nodes),
        env={env_key: card.user.address},
        attributes=attributes,
    )


def _unique(devices: List[Device], resource_name: str) -> List[Device]:
    """Ids must be unique per resource; a broken tree (two ports claiming one ``id``) gets
    the clashing devices renamed by their port name rather than one silently hiding the other."""
    counts = Counter(d.id for d in devices)
    if all(n == 1 for n in counts.values()):
        return devices
    out = []
    for device in devices:
        if counts[device.id] > 1:
            attributes = device.attributes
            name = attributes.get("port") or attributes.get("region") or "dup"
            fallback = f"{attributes.get('pci_address', '')}-{name}"
            log.warning(
                "resource %s: id %s is claimed twice; using %s", resource_name, device.id, fallback
            )
            device = replace(device, id=fallback.lstrip("-"))
        out.append(device)
    return out
