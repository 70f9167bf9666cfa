"""The GPU driver: which PCI functions are GPUs, and what a container needs to use each one.

Rules, chosen so that every GPU the kubelet sees is either fully usable or visibly Unhealthy:

* A GPU is a function of a known GPU vendor (NVIDIA 0x10de, AMD 0x1002, Intel 0x8086) with
  display class (0x03xxxx: VGA, 3D, "other display") or processing-accelerator class (0x12xxxx:
  AMD MI300 reports itself so). NVSwitch (0x0680), HDMI audio (0x0403) and USB-C (0x0c03)
  functions of the same vendors are not GPUs, and neither is the BMC's VGA (ASPEED 0x1a03,
  Matrox 0x102b): an unknown vendor's display is not a compute device. Intel accelerators
  (0x12: the NPU, bound to intel_vpu) count only when i915 or xe drives them.
* The id is the PCI address. It is stable across reboots unless cards move, is known even when
  the vendor driver is not loaded (an NVIDIA UUID is not: the driver prints
  ``GPU-????????-...`` for a GPU it could not initialise), and is the same kind of id for all
  three vendors. The NVIDIA UUID is carried as an attribute and in NVIDIA_VISIBLE_DEVICES.
* NVIDIA: /dev/nvidiaN with N the "Device Minor" of /proc/driver/nvidia/gpus/<addr>/information,
  plus /dev/nvidiactl (required) and /dev/nvidia-uvm, -uvm-tools where present (-modeset, the
  display interface, only with the setting ``nvidia_modeset = true``: see nvidia.py). No
  information file means no minor: the GPU is Unhealthy with the reason, except where it cannot
  be ambiguous and procfs lists no GPU at all (a tree captured or mounted without it): one GPU
  with exactly one /dev/nvidiaN, or N GPUs all bound to nvidia with exactly /dev/nvidia0..N-1,
  numbered in PCI address order (the driver's probe order); both are logged and carried in
  ``device_minor_source``. Two GPUs claiming one minor are both Unhealthy. "GPU Excluded: Yes"
  is Unhealthy.
* AMD: /dev/kfd (required for ROCm) plus the function's own card and render nodes.
  Intel: the function's card and render nodes, and its /dev/dri/by-path links as mounts (the
  Intel user-mode driver finds its GPU through them).
* A function with enable = 0 while a GPU driver owns it is Unhealthy (the driver failed or
  disabled it). A missing device node is Unhealthy, naming the node.
* A function bound to vfio-pci (or pci-stub, or a vfio variant driver) belongs to VM
  passthrough: no resource gets it unless its ``kernel_driver`` selector names that driver
  explicitly; then it is served with /dev/vfio/vfio and /dev/vfio/<group>, and Allocate adds
  KubeVirt's PCI_RESOURCE_<NAME> variable.
* SR-IOV: an Intel or AMD PF with VFs enabled is left on the host and its VFs are served (the
  Intel GPU plugin's rule); NVIDIA VFs are vGPU-manager functions with no container node and
  are skipped.
* AMD compute partitions (amd.py, kfd.py): a GPU with more than one KFD agent is served as its
  partitions; selector ``partition_mode`` gives ROCm's "mixed" names (amd.com/cpx_nps4).
* NVIDIA MIG (mig.py, nvml.py): a GPU in MIG mode is never served whole. Setting
  ``mig_strategy`` has NVIDIA's meaning: "none" (whole GPUs only), "single" (the MIG devices
  under the resource's own name), "mixed" (whole GPUs here; MIG devices under resources that
  select them by ``mig_profile`` (NVML), ``mig_parent``, ``mig_gi``, ``mig_ci``). For a
  resource with ``api = "dra"``, "mixed" serves whole GPUs and MIG devices in the one pool,
  told apart by attributes (DeviceClasses select them), as NVIDIA's DRA driver does.
* Every GPU device says what it is: ``type`` "gpu", "mig", "partition" or "vfio"
  (passthrough), so a DeviceClass's CEL never meets a device without it; a MIG device or
  compute partition names its GPU in ``parent`` (the GPU's id, its PCI address) and its
  ``profile`` (MIG profile from NVML, or the partition mode "cpx_nps4"). A GPU served as its
  partitions is also listed, for DRA pools only, as a "parent" record with ``partitioned =
  "true"``: the slices publish it with shared counters so the scheduler never hands out a GPU
  and one of its partitions together (host/dra/slices.py). The device plugin never serves it.
"""

from __future__ import annotations

import functools
import logging
import re
from dataclasses import replace
from typing import Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple

from device_plugin_host import (
    PCI_SELECTOR_TYPES,
    ContainerAllocation,
    Device,
    DeviceNode,
    Driver,
    Health,
    HostFS,
    Mount,
    PciFunction,
    PreferredRequest,
    ResourceConfig,
    SelectorError,
    check_class_selector,
    check_pci_selectors,
    class_matches,
    class_patterns,
    list_functions,
    pci_matcher,
    selector_values,
)
from drivers.gpu import amd
from drivers.gpu.drm import drm_nodes
from drivers.gpu.kfd import KfdNode, TopologyCache
from drivers.gpu.links import group_of, link_preferred, peers_of
from drivers.gpu.mig import MigDevice, read_mig_devices
from drivers.gpu.nvidia import (
    MODESET_SETTING,
    NvidiaInfo,
    apply_modeset_setting,
    proc_addresses,
    read_information,
)
from drivers.gpu.nvml import NvmlSource, NvmlView, PynvmlSource

logger = logging.getLogger(__name__)

NVIDIA = 0x10DE
AMD = 0x1002
INTEL = 0x8086
VENDORS: Mapping[int, str] = {NVIDIA: "nvidia", AMD: "amd", INTEL: "intel"}

DISPLAY_CLASS = 0x03
ACCELERATOR_CLASS = 0x12
INTEL_GPU_DRIVERS = ("i915", "xe")
EXPECTED_DRIVERS: Mapping[int, Tuple[str, ...]] = {
    NVIDIA: ("nvidia",),
    AMD: ("amdgpu",),
    INTEL: INTEL_GPU_DRIVERS,
}

NVIDIACTL = "/dev/nvidiactl"
NVIDIA_OPTIONAL = ("/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia-modeset")
KFD = "/dev/kfd"
VFIO_CONTAINER = "/dev/vfio/vfio"
PASSTHROUGH_DRIVERS = ("vfio-pci", "pci-stub")
PASSTHROUGH_ATTRIBUTE = "passthrough"
KUBEVIRT_ENV_PREFIX = "PCI_RESOURCE"

_NVIDIA_NODE = re.compile(r"nvidia(\d+)\Z")


MIG_STRATEGIES = ("none", "single", "mixed")
NO_NVML = NvmlView(False, "not needed: no NVIDIA GPU bound to nvidia")
MIG_SELECTORS = ("mig_profile", "mig_parent", "mig_gi", "mig_ci")


class GpuEntry(NamedTuple):  # one per served device and scan: a tuple is cheapest to build
    function: PciFunction
    device: Device
    passthrough: bool
    mig: bool = False  # a MIG device (compute instance) of the function, not the function
    parent: bool = False  # the function served as its partitions: for DRA pools only


class GpuInventory(NamedTuple):
    entries: Tuple[GpuEntry, ...]
    nvml: NvmlView = NO_NVML


class GpuDriver(Driver):
    name = "gpu"
    # A compute repartition rebuilds the KFD topology under the PCI function: its change
    # events arrive as "pci" or "drm"; the safety rescan covers kernels that send none.
    subsystems = ("pci", "drm")
    device_globs = (
        "/dev/nvidia*", "/dev/nvidia-caps/*", "/dev/kfd", "/dev/dri/*", "/dev/dri/by-path/*",
    )
    selector_types = {
        **PCI_SELECTOR_TYPES, "class": (str,), "partition_mode": (str,),
        "mig_profile": (str,), "mig_parent": (str,), "mig_gi": (int,), "mig_ci": (int,),
    }
    setting_types = {"mig_strategy": (str,), MODESET_SETTING: (bool,)}

    def __init__(self, nvml: Optional[NvmlSource] = None) -> None:
        # NVML is asked only when a scan finds NVIDIA GPUs bound to nvidia (see nvml.py).
        self._nvml: NvmlSource = nvml if nvml is not None else PynvmlSource()
        self._kfd = TopologyCache()
        self._mig_seen: Dict[str, int] = {}  # GPU address -> MIG devices at the last scan

    # -- configuration -------------------------------------------------------------------
    def check_selectors(self, selectors: Mapping[str, object]) -> None:
        super().check_selectors(selectors)
        check_pci_selectors(selectors)
        check_class_selector(selectors)
        for value in selector_values(selectors, "partition_mode") or []:
            problem = amd.mode_selector_error(str(value))
            if problem is not None:
                raise SelectorError("partition_mode", problem)

    def check_settings(self, settings: Mapping[str, object]) -> None:
        super().check_settings(settings)
        strategy = settings.get("mig_strategy")
        if strategy is not None and strategy not in MIG_STRATEGIES:
            raise SelectorError(
                "mig_strategy",
                f"{strategy!r} is not a MIG strategy: use one of {', '.join(MIG_STRATEGIES)}",
            )

    def default_resources(self) -> Sequence[ResourceConfig]:
        return (
            ResourceConfig(
                "nvidia.com/gpu", self.name, {"vendor": "0x10de"}, register_when_empty=False
            ),
            ResourceConfig(
                "amd.com/gpu", self.name, {"vendor": "0x1002"}, register_when_empty=False
            ),
            ResourceConfig(
                "gpu.intel.com/i915",
                self.name,
                {"vendor": "0x8086", "kernel_driver": "i915"},
                register_when_empty=False,
            ),
            ResourceConfig(
                "gpu.intel.com/xe",
                self.name,
                {"vendor": "0x8086", "kernel_driver": "xe"},
                register_when_empty=False,
            ),
        )

    # -- discovery -----------------------------------------------------------------------
    def scan(self, host: HostFS) -> GpuInventory:
        gpus = [fn for fn in list_functions(host) if _is_gpu(host, fn)]
        nvidia = [fn for fn in gpus if fn.vendor == NVIDIA and not _is_passthrough(fn)]
        infos = {fn.address: read_information(host, fn.address) for fn in nvidia}
        minors = _nvidia_minors(host, nvidia, infos)
        claims: Dict[int, List[str]] = {}
        for address, (minor, _) in minors.items():
            if minor is not None:
                claims.setdefault(minor, []).append(address)
        bound = [fn for fn in nvidia if fn.kernel_driver == "nvidia"]
        nvml = self._nvml_view() if bound else NO_NVML
        migs = read_mig_devices(host) if bound else {}
        amd_gpus = [fn for fn in gpus if fn.vendor == AMD and not _is_passthrough(fn)]
        kfd, peers = (self._kfd.read(host, frozenset(fn.address for fn in amd_gpus))
                      if amd_gpus else ({}, {}))
        entries = []
        mig_now: Dict[str, int] = {}
        for fn in gpus:
            passthrough = _is_passthrough(fn)
            if passthrough:
                devices = [_passthrough_device(host, fn)]
            elif fn.vendor == NVIDIA:
                minor, note = minors[fn.address]
                others = claims.get(minor, []) if minor is not None else []
                shared = [a for a in others if a != fn.address]
                whole = _nvidia_device(host, fn, infos[fn.address], minor, note, shared)
                linked = nvml.nvlink_peers.get(fn.address)
                if linked:
                    whole = replace(whole, attributes={
                        **whole.attributes, "nvlink_peers": ",".join(sorted(linked))})
                own = migs.get(minor, []) if minor is not None else []
                in_mig = nvml.mig_mode.get(fn.address, bool(own)) if nvml.available else bool(own)
                if in_mig:
                    mig_now[fn.address] = len(own)
                    if self._mig_seen.get(fn.address) != len(own):
                        logger.warning(
                            "gpu %s is in MIG mode (%d MIG devices): never served whole; its"
                            " MIG devices serve with mig_strategy = \"single\" or MIG"
                            " selectors (\"mixed\" for DRA)", fn.address, len(own))
                    entries.append(GpuEntry(fn, replace(whole, attributes={
                        **whole.attributes, "partitioned": "true"}), False, parent=True))
                    for mig in own:
                        device = _mig_device(host, whole, mig, nvml)
                        if not device.healthy:
                            logger.warning("gpu %s: unhealthy: %s", device.id,
                                           device.health_reason)
                        entries.append(GpuEntry(fn, device, False, mig=True))
                    continue
                devices = [whole]
            elif fn.vendor == AMD:
                devices = _amd_devices(host, fn, kfd, peers.get(fn.address, set()))
            else:
                devices = [_drm_device(host, fn, "intel", required=())]
            for device in devices:
                is_parent = device.attributes.get("partitioned") == "true"
                if not device.healthy and not is_parent:
                    logger.warning("gpu %s: unhealthy: %s", device.id, device.health_reason)
                entries.append(GpuEntry(fn, device, passthrough, parent=is_parent))
        for address in sorted(set(self._mig_seen) - set(mig_now)):
            logger.info("gpu %s left MIG mode: served whole again", address)
        self._mig_seen = mig_now
        return GpuInventory(tuple(entries), nvml)

    def _nvml_view(self) -> NvmlView:
        try:
            return self._nvml.read()
        except Exception as error:  # a broken source must not fail the scan
            logger.warning("gpu: NVML source failed: %s", error)
            return NvmlView(False, f"NVML failed: {type(error).__name__}: {error}")

    def select(self, inventory: GpuInventory, resource: ResourceConfig) -> Sequence[Device]:
        selectors = resource.selectors
        named_drivers = selector_values(selectors, "kernel_driver") or []
        patterns = class_patterns(selectors)
        pci_matches = pci_matcher(selectors)
        modes = [str(v) for v in selector_values(selectors, "partition_mode") or []]
        strategy = str(resource.settings.get("mig_strategy", "none"))
        mig_resource = any(key in selectors for key in MIG_SELECTORS)
        dra = resource.api == "dra"
        parents: Dict[str, Device] = {}
        if "mig_profile" in selectors and not inventory.nvml.available:
            logger.warning(
                "resource %s selects mig_profile, which only NVML knows (%s): no MIG device"
                " matches; select by mig_parent / mig_gi / mig_ci instead",
                resource.name, inventory.nvml.reason)
        out = []
        # Partitions and MIG devices share their function: judge each function once.
        verdicts: Dict[str, bool] = {}
        for entry in inventory.entries:
            fn = entry.function
            verdict = verdicts.get(fn.address)
            if verdict is None:
                verdict = verdicts[fn.address] = (
                    (not entry.passthrough or fn.kernel_driver in named_drivers)
                    and pci_matches(fn)
                    and class_matches(fn.pci_class, patterns)
                )
            if not verdict:
                continue
            if modes and not amd.mode_matches(entry.device.attributes.get("partition_mode"), modes):
                continue
            if entry.parent:
                if dra and not mig_resource:
                    parents[fn.address] = entry.device
                continue
            if entry.mig:
                if mig_resource:
                    if not _mig_matches(entry.device, selectors):
                        continue
                elif strategy != "single" and not (dra and strategy == "mixed"):
                    continue
            elif mig_resource:
                continue  # a resource of MIG devices serves no whole GPU
            out.append(apply_modeset_setting(entry.device, resource.settings))
        if strategy == "single" and not mig_resource:
            out = _single_strategy(out)
        if parents:
            # A partitioned GPU goes with its partitions: the slices' counters need it.
            wanted = {d.attributes.get("parent") for d in out}
            out.extend(device for address, device in parents.items() if address in wanted)
        return out

    # -- allocation ----------------------------------------------------------------------
    def preferred(
        self, resource: ResourceConfig, request: PreferredRequest
    ) -> Optional[Sequence[str]]:
        """Link-aware choice (links.py): XGMI/NVLink cliques, then fewest GPUs, then NUMA.
        Replicated resources keep the host's pack/spread policy."""
        if resource.replicas > 1:
            return None
        return link_preferred(request.available, request.must_include, request.size)

    def preferred_useful(self, resource: ResourceConfig, devices: Sequence[Device]) -> bool:
        """link_preferred has something to go by: link facts, or partitions (MIG devices,
        compute partitions) of one GPU, which it keeps together. Otherwise it answers None."""
        if resource.replicas > 1:
            return False
        groups = set()
        for device in devices:
            group = group_of(device)
            if group in groups or peers_of(device):
                return True
            groups.add(group)
        return False

    def allocate(
        self, resource: ResourceConfig, devices: Sequence[Device], merged: ContainerAllocation
    ) -> ContainerAllocation:
        """KubeVirt finds passthrough devices by a variable named after the *resource*, which
        no single Device knows; everything else is the host's merge of per-device data."""
        addresses = [
            d.attributes.get("pci_address", d.id)
            for d in devices
            if d.attributes.get(PASSTHROUGH_ATTRIBUTE) == "true"
        ]
        if not addresses:
            return merged
        key = kubevirt_env_name(resource.name)
        return replace(merged, envs={**merged.envs, key: ",".join(addresses)})


# -- classification ---------------------------------------------------------------------------
def _is_gpu(host: HostFS, fn: PciFunction) -> bool:
    """True for a function this driver serves; logs why a GPU-vendor function is left out
    when that is not obvious from its class."""
    if fn.vendor not in VENDORS:
        return False
    if fn.pci_class is None:
        logger.warning(
            "gpu: skipping %s (vendor 0x%04x): class unreadable or not a number",
            fn.address,
            fn.vendor,
        )
        return False
    if fn.base_class not in (DISPLAY_CLASS, ACCELERATOR_CLASS):
        return False  # NVSwitch, HDMI audio, USB-C, chipset functions
    if (
        fn.vendor == INTEL
        and fn.base_class == ACCELERATOR_CLASS
        and fn.kernel_driver not in INTEL_GPU_DRIVERS
    ):
        logger.debug(
            "gpu: %s is an Intel accelerator driven by %s, not a GPU", fn.address, fn.kernel_driver
        )
        return False
    if fn.vendor == NVIDIA and host.readlink(f"{fn.path}/physfn") is not None:
        logger.info(
            "gpu: skipping %s: NVIDIA SR-IOV virtual function (vGPU), no device node", fn.address
        )
        return False
    if fn.vendor in (AMD, INTEL):
        numvfs = host.read_int(f"{fn.path}/sriov_numvfs", 10)
        if numvfs:
            logger.info("gpu: leaving %s to its %d SR-IOV virtual functions", fn.address, numvfs)
            return False
    return True


def _is_passthrough(fn: PciFunction) -> bool:
    name = fn.kernel_driver or ""
    return name in PASSTHROUGH_DRIVERS or "vfio" in name


def _mig_matches(device: Device, selectors: Mapping[str, object]) -> bool:
    attributes = device.attributes
    for key, attribute in (("mig_profile", "mig_profile"), ("mig_parent", "pci_address"),
                           ("mig_gi", "mig_gi"), ("mig_ci", "mig_ci")):
        wanted = selector_values(selectors, key)
        if wanted is None:
            continue
        have = attributes.get(attribute)
        if have is None or have.lower() not in {str(v).strip().lower() for v in wanted}:
            return False
    return True


def _single_strategy(devices: List[Device]) -> List[Device]:
    """NVIDIA's "single": every GPU in MIG mode with one profile, MIG devices served under the
    resource's name. A node that breaks the rule gets the offending devices Unhealthy with
    the reason (NVIDIA's plugin refuses to start instead); without MIG devices it is "none"."""
    migs = [d for d in devices if "mig_ci" in d.attributes]
    if not migs:
        return devices
    profiles = sorted({d.attributes["mig_profile"] for d in migs if "mig_profile" in d.attributes})
    out = []
    for device in devices:
        if "mig_ci" not in device.attributes and device.attributes.get("gpu_vendor") == "nvidia":
            device = _add_problem(device, 'mig_strategy "single": this GPU is not in MIG mode'
                                  ' while others are; use "mixed"')
        elif len(profiles) > 1 and "mig_ci" in device.attributes:
            device = _add_problem(device, 'mig_strategy "single" needs one MIG profile on the'
                                  f' node, found {", ".join(profiles)}; use "mixed"')
        out.append(device)
    return out


def kubevirt_env_name(resource_name: str) -> str:
    """KubeVirt's ResourceNameToEnvVar("PCI_RESOURCE", name)."""
    return f"{KUBEVIRT_ENV_PREFIX}_" + resource_name.upper().replace("/", "_").replace(".", "_")


# -- NVIDIA -------------------------------------------------------------------------------------
def _nvidia_minors(
    host: HostFS, gpus: Sequence[PciFunction], infos: Mapping[str, Optional[NvidiaInfo]]
) -> Dict[str, Tuple[Optional[int], str]]:
    """Each NVIDIA GPU's minor, with a note saying where it came from or why it is unknown."""
    out: Dict[str, Tuple[Optional[int], str]] = {}
    for fn in gpus:
        info = infos.get(fn.address)
        if info is not None:
            if info.minor is not None:
                out[fn.address] = (info.minor, "proc")
            else:
                out[fn.address] = (
                    None,
                    f"Device Minor {info.minor_text!r} in {info.path} is not a GPU minor"
                    if info.minor_text is not None
                    else f"no Device Minor in {info.path}",
                )
        elif fn.kernel_driver != "nvidia":
            out[fn.address] = (None, "device minor unknown")  # the driver problem says why
        else:
            out[fn.address] = (
                None,
                f"device minor unknown: no /proc/driver/nvidia/gpus/{fn.address}/information"
                " (host /proc not visible under the root?)",
            )
    sole = _sole_node_minor(host, gpus, infos)
    if sole is not None:
        address, minor = sole
        logger.warning(
            "gpu %s: no /proc/driver/nvidia information; using /dev/nvidia%d, the only GPU node"
            " for the only NVIDIA GPU",
            address,
            minor,
        )
        out[address] = (minor, "sole-node")
        return out
    for address, minor in _pci_order_minors(host, gpus, infos).items():
        out[address] = (minor, "pci-order")
    return out


def _pci_order_minors(
    host: HostFS, gpus: Sequence[PciFunction], infos: Mapping[str, Optional[NvidiaInfo]]
) -> Dict[str, int]:
    """Minors without procfs (a tree captured or mounted without /proc/driver/nvidia): the
    driver numbers GPUs in the order it probes them, which is PCI address order. Used only
    when it cannot be ambiguous: procfs lists no GPU at all, every NVIDIA GPU is bound to
    nvidia, and /dev holds exactly the nodes 0..N-1 for the N GPUs."""
    if len(gpus) < 2 or any(infos.get(fn.address) for fn in gpus) or proc_addresses(host):
        return {}
    if any(fn.kernel_driver != "nvidia" for fn in gpus):
        return {}
    minors = sorted(int(m.group(1)) for m in map(_NVIDIA_NODE.match, host.listdir("/dev")) if m)
    if minors != list(range(len(gpus))):
        return {}
    ordered = sorted(gpus, key=lambda fn: fn.address)
    logger.warning(
        "no /proc/driver/nvidia information for %d NVIDIA GPUs; assigning /dev/nvidia0..%d in "
        "PCI address order (the driver's probe order)", len(gpus), len(gpus) - 1,
    )
    return {fn.address: index for index, fn in enumerate(ordered)}


def _sole_node_minor(
    host: HostFS, gpus: Sequence[PciFunction], infos: Mapping[str, Optional[NvidiaInfo]]
) -> Optional[Tuple[str, int]]:
    """The one case where the minor is certain without procfs: one GPU, one node."""
    if len(gpus) != 1 or gpus[0].kernel_driver != "nvidia" or infos.get(gpus[0].address):
        return None
    if proc_addresses(host):
        return None  # the driver lists GPUs but not this one: something else is going on
    minors = [int(m.group(1)) for m in map(_NVIDIA_NODE.match, host.listdir("/dev")) if m]
    if len(minors) != 1:
        return None
    return gpus[0].address, minors[0]


def _nvidia_device(
    host: HostFS,
    fn: PciFunction,
    info: Optional[NvidiaInfo],
    minor: Optional[int],
    note: str,
    shared_with: Sequence[str],
) -> Device:
    problems = _driver_problems(host, fn)
    attributes = {**fn.attributes(), "gpu_vendor": "nvidia", "type": "gpu"}
    paths: List[str] = []
    if minor is None:
        problems.append(note)
    else:
        attributes["device_minor"] = str(minor)
        if note == "sole-node":
            attributes["device_minor_source"] = "sole /dev/nvidiaN node"
        elif note == "pci-order":
            attributes["device_minor_source"] = "PCI address order (no procfs)"
        paths.append(f"/dev/nvidia{minor}")
        if shared_with:
            problems.append(f"device minor {minor} also claimed by {', '.join(shared_with)}")
    paths.append(NVIDIACTL)
    problems.extend(_missing(host, paths))
    paths.extend(p for p in NVIDIA_OPTIONAL if host.exists(p))
    if info is not None:
        if info.excluded:
            problems.append("excluded by the NVIDIA driver (GPU Excluded: Yes)")
        if info.model:
            attributes["model"] = info.model
        if info.uuid:
            attributes["uuid"] = info.uuid
        if info.vbios:
            attributes["vbios"] = info.vbios
    visible = info.uuid if info is not None and info.uuid else fn.address
    return _device(fn, paths, problems, attributes, env={"NVIDIA_VISIBLE_DEVICES": visible})


def _mig_device(host: HostFS, parent: Device, mig: MigDevice, nvml: NvmlView) -> Device:
    """A MIG device: the parent's nodes (minus nothing: CUDA opens /dev/nvidiaN of the parent)
    plus the GI and CI capability nodes, the parent's NUMA node and health."""
    address = parent.attributes["pci_address"]
    problems = [parent.health_reason] if parent.health_reason else []
    problems.extend(mig.problems)
    caps = list(mig.cap_nodes)
    problems.extend(_missing(host, caps))
    nodes = [n.host_path for n in parent.device_nodes]
    nodes[1:1] = caps  # /dev/nvidiaN, its caps, then the control nodes
    attributes = {
        k: v for k, v in parent.attributes.items()
        if k not in ("uuid", "device_minor_source", "nvlink_peers", "partitioned")
    }
    attributes.update({
        "type": "mig",
        "parent": address,
        "mig_parent_minor": str(mig.gpu_minor),
        "mig_gi": str(mig.gi),
        "mig_ci": str(mig.ci),
    })
    if mig.gi_cap is not None:
        attributes["mig_gi_cap"] = str(mig.gi_cap)
    if mig.ci_cap is not None:
        attributes["mig_ci_cap"] = str(mig.ci_cap)
    if "uuid" in parent.attributes:
        attributes["parent_uuid"] = parent.attributes["uuid"]
    env: Dict[str, str] = {}
    known = nvml.migs.get((address, mig.gi, mig.ci)) if nvml.available else None
    if known is not None:
        if known.profile:
            attributes["mig_profile"] = known.profile
            attributes["profile"] = known.profile
        if known.uuid:
            attributes["mig_uuid"] = known.uuid
            env["NVIDIA_VISIBLE_DEVICES"] = known.uuid
    elif nvml.available:
        attributes["nvml"] = "NVML lists no MIG device with these GPU/compute instance ids"
    else:
        attributes["nvml"] = (f"not available: {nvml.reason}; it would add mig_profile and"
                              " mig_uuid")
    if "NVIDIA_VISIBLE_DEVICES" not in env and "uuid" in parent.attributes:
        # The R450-era MIG name the container toolkit still resolves, from procfs facts only.
        env["NVIDIA_VISIBLE_DEVICES"] = f"MIG-{parent.attributes['uuid']}/{mig.gi}/{mig.ci}"
    unique = list(dict.fromkeys(problems))
    return Device(
        id=f"{address}-gi{mig.gi}-ci{mig.ci}",
        health=Health.UNHEALTHY if unique else Health.HEALTHY,
        health_reason="; ".join(unique),
        numa_nodes=parent.numa_nodes,
        device_nodes=tuple(DeviceNode(p, p, "rw") for p in dict.fromkeys(nodes)),
        env=env,
        attributes=attributes,
    )


# -- AMD and Intel ------------------------------------------------------------------------------
def _drm_device(host: HostFS, fn: PciFunction, vendor: str, required: Sequence[str]) -> Device:
    problems = _driver_problems(host, fn)
    attributes = {**fn.attributes(), "gpu_vendor": vendor, "type": "gpu"}
    drm = drm_nodes(host, fn.path)
    paths = list(required) + [f"/dev/dri/{name}" for name in drm.names]
    if not drm.renders:
        problems.append(f"no DRM render node under {fn.path}/drm")
    if drm.cards:
        attributes["drm_card"] = ",".join(drm.cards)
    if drm.renders:
        attributes["drm_render"] = ",".join(drm.renders)
    problems.extend(_missing(host, paths))
    mounts: List[Mount] = []
    if vendor == "amd":
        _add_amd_identity(host, fn, attributes)
    else:
        for kind in ("card", "render"):
            link = f"/dev/dri/by-path/pci-{fn.address}-{kind}"
            if host.readlink(link) is not None and host.exists(link):  # not dangling
                mounts.append(Mount(link, link, read_only=True))
    return _device(fn, paths, problems, attributes, mounts=mounts)


def _add_amd_identity(host: HostFS, fn: PciFunction, attributes: Dict[str, str]) -> None:
    for name in ("product_name", "unique_id"):
        value = host.read(f"{fn.path}/{name}")
        if value:
            attributes[name] = value


def _amd_devices(
    host: HostFS, fn: PciFunction, kfd: Mapping[str, Sequence[KfdNode]], peers: set
) -> List[Device]:
    """The whole GPU, or its partitions when KFD lists more than one agent for it."""
    mode = amd.read_mode(host.read, fn.path)
    parts = amd.partitions_of(kfd.get(fn.address, ()))
    if len(parts) <= 1:
        own = _drm_device(host, fn, "amd", required=(KFD,))
        whole: Optional[Device] = own
        facts = own.attributes
    else:
        # Served as its partitions: the GPU's own card/render nodes and their health are
        # not handed out, so only its facts are read (what _drm_device would report).
        whole = None
        facts = {**fn.attributes(), "gpu_vendor": "amd", "type": "gpu"}
        _add_amd_identity(host, fn, facts)
    extra: Dict[str, str] = {}
    if mode.name is not None:
        extra["partition_mode"] = mode.name
        extra["compute_partition"] = mode.compute or ""
        if mode.memory:
            extra["memory_partition"] = mode.memory
        if mode.available:
            extra["available_compute_partitions"] = ",".join(mode.available)
    vram = host.read_int(f"{fn.path}/mem_info_vram_total", 10)
    if vram:
        extra["memory_bytes"] = str(vram)
    if "product_name" in facts:
        extra["product"] = facts["product_name"]
    if peers:
        extra["xgmi_peers"] = ",".join(sorted(peers))
    if whole is not None:
        device = replace(whole, attributes={**facts, **extra})
        if mode.partitioned:
            found = "one KFD node" if parts else "no KFD topology node"
            return [_add_problem(device, (
                f"compute partition {mode.compute} but {found} for it (repartition in progress,"
                " or amdgpu's KFD not loaded): neither the whole GPU nor its partitions can be"
                " served"))]
        return [device]
    # What every partition shares is worked out once: an MI300X node has 64 of them.
    shared = _driver_problems(host, fn) + _missing(host, [KFD])
    base = {**facts, **extra}
    # The GPU itself, for DRA pools only (GpuEntry.parent): never served, only counted.
    parent = _drm_device(host, fn, "amd", required=(KFD,))
    parent = replace(parent, attributes={**base, "partitioned": "true"})
    base.update({"type": "partition", "parent": fn.address})
    if mode.name is not None:
        base["profile"] = mode.name
    duplicates = amd.duplicate_indices(parts)
    count = len(parts)
    base["partition_count"] = str(count)
    if vram:
        base["memory_bytes"] = str(vram // count)  # the GPU's memory over its partitions
    out = []
    kfd_node = _node(KFD)
    exists = host.exists
    address, numa = fn.address, fn.numa_nodes
    # Kept tight: 64 of these per scan on an MI300X node in CPX. A healthy partition (the
    # common case) skips the problem list; the attributes keep base's key order.
    for part in parts:
        render = "/dev/dri/" + part.render
        attributes = {**base, "partition_index": str(part.number), "drm_render": part.render}
        missing = not exists(render)
        if missing or shared or part.number in duplicates:
            problems = list(shared)
            if missing:
                problems.append(f"device node {render} missing")
            if part.number in duplicates:
                problems.append(
                    f"KFD lists partition {part.number} {duplicates[part.number]} times")
            health, reason = Health.UNHEALTHY, "; ".join(dict.fromkeys(problems))
        else:
            health, reason = Health.HEALTHY, ""
        out.append(Device(
            id=amd.partition_id(address, part.number),
            health=health,
            health_reason=reason,
            numa_nodes=numa,
            device_nodes=(kfd_node, _node(render)),
            attributes=attributes,
        ))
    out.append(parent)
    return out


def _add_problem(device: Device, problem: str) -> Device:
    reason = "; ".join(r for r in (device.health_reason, problem) if r)
    return device.with_health(Health.UNHEALTHY, reason)


# -- passthrough --------------------------------------------------------------------------------
def _passthrough_device(host: HostFS, fn: PciFunction) -> Device:
    attributes = {
        **fn.attributes(),
        "gpu_vendor": VENDORS.get(fn.vendor or 0, "unknown"),
        "type": "vfio",
        PASSTHROUGH_ATTRIBUTE: "true",
    }
    problems: List[str] = []
    paths = [VFIO_CONTAINER]
    if fn.iommu_group is None:
        problems.append("bound to a passthrough driver but has no IOMMU group")
    else:
        paths.append(f"/dev/vfio/{fn.iommu_group}")
    problems.extend(_missing(host, paths))
    # vfio-pci enables the function only while a VM holds it: enable = 0 is normal here.
    return _device(fn, paths, problems, attributes)


# -- shared -------------------------------------------------------------------------------------
def _driver_problems(host: HostFS, fn: PciFunction) -> List[str]:
    """A GPU driver that failed to bind, or the wrong one, leaves the GPU unusable."""
    problems = []
    expected = EXPECTED_DRIVERS.get(fn.vendor or 0, ())
    if fn.kernel_driver is None:
        problems.append(f"no kernel driver bound (expected {' or '.join(expected)})")
    elif fn.kernel_driver not in expected:
        problems.append(f"bound to {fn.kernel_driver}, not {' or '.join(expected)}")
    if fn.enabled is False:  # read once by host.sysfs.pci (the enable file counts enables)
        problems.append("PCI function disabled (enable = 0)")
    return problems


def _missing(host: HostFS, paths: Sequence[str]) -> List[str]:
    return [f"device node {path} missing" for path in paths if not host.exists(path)]


def _device(
    fn: PciFunction,
    paths: Sequence[str],
    problems: Sequence[str],
    attributes: Dict[str, str],
    env: Optional[Mapping[str, str]] = None,
    mounts: Sequence[Mount] = (),
    device_id: Optional[str] = None,
) -> Device:
    unique = list(dict.fromkeys(problems))
    return Device(
        id=device_id or fn.address,
        health=Health.UNHEALTHY if unique else Health.HEALTHY,
        health_reason="; ".join(unique),
        numa_nodes=fn.numa_nodes,
        device_nodes=tuple(_node(p) for p in dict.fromkeys(paths)),
        mounts=tuple(mounts),
        env=dict(env or {}),
        attributes=attributes,
    )


@functools.lru_cache(maxsize=8192)
def _node(path: str) -> DeviceNode:
    """DeviceNodes are immutable: one per path is shared by every scan (and by the 64
    partitions of an MI300X node that all carry /dev/kfd)."""
    return DeviceNode(path, path, "rw")
