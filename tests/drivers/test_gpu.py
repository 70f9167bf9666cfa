"""The GPU driver against fake trees in the kernel's shapes, and the captured 8-GPU server."""

from __future__ import annotations

import logging
import os
from typing import Dict, List, Sequence

import pytest

from device_plugin_host_testing.machines import load_machine
from drivers.gpu import plugin
from drivers.gpu.driver import GpuDriver, kubevirt_env_name
from drivers.gpu.nvidia import parse_information, read_information
from host.core.driver import SelectorError
from host.core.hostfs import HostFS
from host.core.model import ContainerAllocation, Device, DeviceNode, Health, Mount, ResourceConfig
from host.sim.fake_gpu import (
    add_amd_gpu,
    add_drm,
    add_intel_gpu,
    add_nvidia_control_nodes,
    add_nvidia_gpu,
    gpu_uuid,
    nvidia_information,
)
from host.sim.tree import FakeTree

NVIDIA_GPU = ResourceConfig("nvidia.com/gpu", "gpu", {"vendor": "0x10de"})
AMD_GPU = ResourceConfig("amd.com/gpu", "gpu", {"vendor": "0x1002"})
I915 = ResourceConfig("gpu.intel.com/i915", "gpu", {"vendor": "0x8086", "kernel_driver": "i915"})
XE = ResourceConfig("gpu.intel.com/xe", "gpu", {"vendor": "0x8086", "kernel_driver": "xe"})
ALL = ResourceConfig("example.com/any-gpu", "gpu", {})


@pytest.fixture
def tree(tmp_path) -> FakeTree:
    fake = FakeTree(tmp_path / "root")
    fake.numa_nodes(2)
    return fake


def discover(tree: FakeTree, *resources: ResourceConfig) -> Dict[str, List[Device]]:
    found = GpuDriver().discover(HostFS(tree.root), resources or (ALL,))
    return {name: list(devices) for name, devices in found.items()}


def devices_of(tree: FakeTree, resource: ResourceConfig = ALL) -> Dict[str, Device]:
    return {d.id: d for d in discover(tree, resource)[resource.name]}


def node_paths(device: Device) -> List[str]:
    return [node.host_path for node in device.device_nodes]


# -- NVIDIA ---------------------------------------------------------------------------------------
def test_nvidia_gpu_carries_its_minor_node_control_nodes_and_env(tree):
    add_nvidia_control_nodes(tree)
    add_nvidia_gpu(tree, "0000:3b:00.0", minor=3, numa_node=1, local_cpulist="4-7",
                   iommu_group=12)
    device = devices_of(tree, NVIDIA_GPU)["0000:3b:00.0"]

    assert device.health is Health.HEALTHY, device.health_reason
    assert node_paths(device) == [  # no /dev/nvidia-modeset by default
        "/dev/nvidia3", "/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools",
    ]
    assert all(n.permissions == "rw" and n.container_path == n.host_path
               for n in device.device_nodes)
    assert device.env == {"NVIDIA_VISIBLE_DEVICES": gpu_uuid("0000:3b:00.0")}
    assert device.numa_nodes == (1,)
    assert device.attributes["uuid"] == gpu_uuid("0000:3b:00.0")
    assert device.attributes["model"] == "NVIDIA H100 80GB HBM3"
    assert device.attributes["device_minor"] == "3"
    assert device.attributes["vbios"] == "96.00.74.00.01"
    assert device.attributes["pci_address"] == "0000:3b:00.0"
    assert device.attributes["vendor"] == "0x10de"
    assert device.attributes["device"] == "0x2330"
    assert device.attributes["class"] == "0x030200"
    assert device.attributes["kernel_driver"] == "nvidia"
    assert device.attributes["local_cpulist"] == "4-7"
    assert device.attributes["iommu_group"] == "12"
    assert device.attributes["gpu_vendor"] == "nvidia"


def test_nvidia_minor_comes_from_procfs_not_pci_order(tree):
    add_nvidia_control_nodes(tree)
    add_nvidia_gpu(tree, "0000:18:00.0", minor=1)
    add_nvidia_gpu(tree, "0000:9a:00.0", minor=0)
    found = devices_of(tree, NVIDIA_GPU)
    assert node_paths(found["0000:18:00.0"])[0] == "/dev/nvidia1"
    assert node_paths(found["0000:9a:00.0"])[0] == "/dev/nvidia0"
    assert all(d.healthy for d in found.values())


def test_nvidia_optional_control_nodes_only_where_present(tree):
    add_nvidia_control_nodes(tree, uvm=False, uvm_tools=False, modeset=False)
    add_nvidia_gpu(tree, "0000:18:00.0", minor=0)
    device = devices_of(tree, NVIDIA_GPU)["0000:18:00.0"]
    assert device.healthy
    assert node_paths(device) == ["/dev/nvidia0", "/dev/nvidiactl"]


def test_nvidia_missing_nvidiactl_is_unhealthy(tree):
    add_nvidia_control_nodes(tree, ctl=False)
    add_nvidia_gpu(tree, "0000:18:00.0", minor=0)
    device = devices_of(tree, NVIDIA_GPU)["0000:18:00.0"]
    assert device.health is Health.UNHEALTHY
    assert "/dev/nvidiactl" in device.health_reason


def test_nvidia_missing_gpu_node_is_unhealthy_then_healthy_when_it_returns(tree, caplog):
    add_nvidia_control_nodes(tree)
    add_nvidia_gpu(tree, "0000:18:00.0", minor=5, dev_node=False)
    with caplog.at_level(logging.WARNING, logger="drivers.gpu.driver"):
        device = devices_of(tree, NVIDIA_GPU)["0000:18:00.0"]
    assert device.health is Health.UNHEALTHY
    assert device.health_reason == "device node /dev/nvidia5 missing"
    assert "0000:18:00.0" in caplog.text and "/dev/nvidia5" in caplog.text

    tree.chardev("/dev/nvidia5", 195, 5)
    again = devices_of(tree, NVIDIA_GPU)["0000:18:00.0"]
    assert again.healthy and again.health_reason == ""


def test_nvidia_without_information_file_is_unhealthy_when_ambiguous(tree):
    add_nvidia_control_nodes(tree)
    # Nodes 0 and 2 for two GPUs: not 0..N-1, so PCI order cannot be trusted either.
    add_nvidia_gpu(tree, "0000:18:00.0", minor=0, information=None)
    add_nvidia_gpu(tree, "0000:9a:00.0", minor=2, information=None)
    found = devices_of(tree, NVIDIA_GPU)
    for address, device in found.items():
        assert device.health is Health.UNHEALTHY
        assert "device minor unknown" in device.health_reason
        assert f"/proc/driver/nvidia/gpus/{address}/information" in device.health_reason
        # No guessed node, but the env still names the GPU the runtime hook should expose.
        assert not any(p.startswith("/dev/nvidia0") or p == "/dev/nvidia2"
                       for p in node_paths(device))
        assert device.env == {"NVIDIA_VISIBLE_DEVICES": address}


def test_nvidia_sole_gpu_and_sole_node_is_used_and_logged(tree, caplog):
    add_nvidia_control_nodes(tree)
    add_nvidia_gpu(tree, "0000:18:00.0", minor=2, information=None)
    with caplog.at_level(logging.WARNING, logger="drivers.gpu.driver"):
        device = devices_of(tree, NVIDIA_GPU)["0000:18:00.0"]
    assert device.healthy, device.health_reason
    assert node_paths(device)[0] == "/dev/nvidia2"
    assert device.attributes["device_minor"] == "2"
    assert device.attributes["device_minor_source"] == "sole /dev/nvidiaN node"
    assert "0000:18:00.0" in caplog.text and "/dev/nvidia2" in caplog.text


def test_nvidia_sole_gpu_with_two_nodes_is_not_guessed(tree):
    add_nvidia_control_nodes(tree)
    add_nvidia_gpu(tree, "0000:18:00.0", minor=0, information=None)
    tree.chardev("/dev/nvidia1", 195, 1)
    device = devices_of(tree, NVIDIA_GPU)["0000:18:00.0"]
    assert device.health is Health.UNHEALTHY
    assert "device minor unknown" in device.health_reason


def test_nvidia_sole_gpu_missing_from_a_populated_proc_is_not_guessed(tree):
    add_nvidia_control_nodes(tree)
    add_nvidia_gpu(tree, "0000:18:00.0", minor=0, information=None)
    tree.attr("/proc/driver/nvidia/gpus/0000:99:00.0/information",
              nvidia_information("0000:99:00.0", 0))
    device = devices_of(tree, NVIDIA_GPU)["0000:18:00.0"]
    assert device.health is Health.UNHEALTHY


def test_nvidia_driver_not_loaded(tree):
    add_nvidia_control_nodes(tree, ctl=False, uvm=False, uvm_tools=False, modeset=False)
    path = add_nvidia_gpu(tree, "0000:18:00.0", minor=None, driver=None, information=None)
    tree.attr(f"{path}/enable", "0")
    device = devices_of(tree, NVIDIA_GPU)["0000:18:00.0"]
    assert device.health is Health.UNHEALTHY
    assert "no kernel driver bound (expected nvidia)" in device.health_reason
    assert "PCI function disabled" in device.health_reason
    assert "kernel_driver" not in device.attributes


def test_captured_tree_driver_link_may_dangle(tree):
    """capture_tree keeps ``driver`` links but not /sys/bus/pci/drivers: the name is enough."""
    add_nvidia_control_nodes(tree)
    add_nvidia_gpu(tree, "0000:18:00.0", minor=0)
    tree.remove("/sys/bus/pci/drivers/nvidia")
    device = devices_of(tree, NVIDIA_GPU)["0000:18:00.0"]
    assert device.healthy, device.health_reason
    assert device.attributes["kernel_driver"] == "nvidia"


def test_nvidia_bound_to_nouveau_is_unhealthy(tree):
    add_nvidia_control_nodes(tree)
    add_nvidia_gpu(tree, "0000:18:00.0", minor=None, driver="nouveau", information=None)
    add_drm(tree, "/sys/devices/pci0000:18/0000:18:00.0", card=1, render=128)
    device = devices_of(tree, NVIDIA_GPU)["0000:18:00.0"]
    assert device.health is Health.UNHEALTHY
    assert "bound to nouveau, not nvidia" in device.health_reason
    assert not any(p.startswith("/dev/dri") for p in node_paths(device))


@pytest.mark.parametrize("line", ["GPU Excluded:\t Yes", "Blacklisted:\t Yes"])
def test_nvidia_excluded_gpu_is_unhealthy(tree, line):
    add_nvidia_control_nodes(tree)
    text = nvidia_information("0000:18:00.0", 0).replace("GPU Excluded:\t No", line)
    add_nvidia_gpu(tree, "0000:18:00.0", minor=0, information=text)
    add_nvidia_gpu(tree, "0000:2a:00.0", minor=1)
    found = devices_of(tree, NVIDIA_GPU)
    assert found["0000:18:00.0"].health is Health.UNHEALTHY
    assert "excluded" in found["0000:18:00.0"].health_reason
    assert found["0000:2a:00.0"].healthy


def test_nvidia_unknown_uuid_falls_back_to_pci_address_in_env(tree):
    add_nvidia_control_nodes(tree)
    add_nvidia_gpu(tree, "0000:18:00.0", minor=0,
                   uuid="GPU-????????-????-????-????-????????????", vbios="??.??.??.??.??")
    add_nvidia_gpu(tree, "0000:2a:00.0", minor=1, uuid=None)
    found = devices_of(tree, NVIDIA_GPU)
    for address in ("0000:18:00.0", "0000:2a:00.0"):
        assert found[address].healthy
        assert found[address].env == {"NVIDIA_VISIBLE_DEVICES": address}
        assert "uuid" not in found[address].attributes
    assert "vbios" not in found["0000:18:00.0"].attributes


@pytest.mark.parametrize("minor", ["garbage", "-1", "255", ""])
def test_nvidia_garbage_minor_is_unhealthy_with_the_text(tree, minor):
    add_nvidia_control_nodes(tree)
    add_nvidia_gpu(tree, "0000:18:00.0", minor=None,
                   information=nvidia_information("0000:18:00.0", minor))
    tree.chardev("/dev/nvidia0", 195, 0)
    device = devices_of(tree, NVIDIA_GPU)["0000:18:00.0"]
    assert device.health is Health.UNHEALTHY
    assert "Device Minor" in device.health_reason
    assert "/dev/nvidia0" not in node_paths(device)


def test_nvidia_minor_claimed_twice_marks_both(tree):
    add_nvidia_control_nodes(tree)
    add_nvidia_gpu(tree, "0000:18:00.0", minor=0)
    add_nvidia_gpu(tree, "0000:2a:00.0", minor=0)
    add_nvidia_gpu(tree, "0000:3a:00.0", minor=1)
    found = devices_of(tree, NVIDIA_GPU)
    assert "also claimed by 0000:2a:00.0" in found["0000:18:00.0"].health_reason
    assert "also claimed by 0000:18:00.0" in found["0000:2a:00.0"].health_reason
    assert found["0000:3a:00.0"].healthy


def test_information_file_that_cannot_be_read_counts_as_missing(tree):
    add_nvidia_control_nodes(tree)
    add_nvidia_gpu(tree, "0000:18:00.0", minor=0, information=None)
    add_nvidia_gpu(tree, "0000:2a:00.0", minor=1)
    tree.mkdir("/proc/driver/nvidia/gpus/0000:18:00.0/information")  # EISDIR on read
    found = devices_of(tree, NVIDIA_GPU)
    assert found["0000:18:00.0"].health is Health.UNHEALTHY
    assert found["0000:2a:00.0"].healthy


def test_parse_information_keeps_bus_location_whole():
    fields = parse_information(nvidia_information("0000:18:00.0", 7) + "garbage line\n")
    assert fields["Bus Location"] == "0000:18:00.0"
    assert fields["Device Minor"] == "7"
    assert fields["GPU Excluded"] == "No"
    assert fields["Model"] == "NVIDIA H100 80GB HBM3"


def test_read_information_on_old_driver_without_uuid_or_excluded(tree):
    text = (
        "Model: \t\t Tesla K80\nIRQ:   \t\t 39\nBus Location: \t 0000:03:00.0\n"
        "Device Minor: \t 4\n"
    )
    tree.attr("/proc/driver/nvidia/gpus/0000:03:00.0/information", text)
    info = read_information(HostFS(tree.root), "0000:03:00.0")
    assert info is not None
    assert (info.minor, info.uuid, info.excluded, info.model) == (4, None, False, "Tesla K80")
    assert read_information(HostFS(tree.root), "0000:04:00.0") is None


# -- AMD ------------------------------------------------------------------------------------------
def test_amd_gpu_gets_kfd_and_its_own_drm_nodes(tree):
    bmc = tree.pci_function("0000:03:00.0", vendor=0x1A03, device=0x2000, pci_class=0x030000,
                            driver="ast", numa_node=0)
    add_drm(tree, bmc, card=0)
    add_amd_gpu(tree, "0000:c1:00.0", card=2, render=129, numa_node=1)
    add_amd_gpu(tree, "0000:83:00.0", card=1, render=128, numa_node=1)
    found = devices_of(tree, AMD_GPU)
    assert set(found) == {"0000:83:00.0", "0000:c1:00.0"}
    device = found["0000:c1:00.0"]
    assert device.healthy, device.health_reason
    assert node_paths(device) == ["/dev/kfd", "/dev/dri/card2", "/dev/dri/renderD129"]
    assert all(n.permissions == "rw" for n in device.device_nodes)
    assert device.attributes["drm_card"] == "card2"
    assert device.attributes["drm_render"] == "renderD129"
    assert device.attributes["product_name"] == "AMD Instinct MI210"
    assert device.attributes["gpu_vendor"] == "amd"
    assert device.numa_nodes == (1,)
    assert device.env == {}
    assert node_paths(found["0000:83:00.0"])[1:] == ["/dev/dri/card1", "/dev/dri/renderD128"]


def test_amd_mi300x_processing_accelerator_class_counts(tree):
    add_amd_gpu(tree, "0000:05:00.0", device=0x74A1, pci_class=0x120000)
    device = devices_of(tree, AMD_GPU)["0000:05:00.0"]
    assert device.healthy
    assert device.attributes["class"] == "0x120000"


def test_amd_without_kfd_is_unhealthy(tree):
    add_amd_gpu(tree, "0000:c1:00.0", kfd=False)
    device = devices_of(tree, AMD_GPU)["0000:c1:00.0"]
    assert device.health is Health.UNHEALTHY
    assert device.health_reason == "device node /dev/kfd missing"


def test_amd_missing_render_node_is_unhealthy_naming_it(tree):
    add_amd_gpu(tree, "0000:c1:00.0", card=1, render=128)
    tree.remove("/dev/dri/renderD128")
    device = devices_of(tree, AMD_GPU)["0000:c1:00.0"]
    assert device.health is Health.UNHEALTHY
    assert device.health_reason == "device node /dev/dri/renderD128 missing"


def test_amd_without_amdgpu_bound_has_no_drm_and_is_unhealthy(tree):
    add_amd_gpu(tree, "0000:c1:00.0", driver=None)
    device = devices_of(tree, AMD_GPU)["0000:c1:00.0"]
    assert device.health is Health.UNHEALTHY
    assert "no kernel driver bound (expected amdgpu)" in device.health_reason
    assert "no DRM render node" in device.health_reason
    assert node_paths(device) == ["/dev/kfd"]


def test_dangling_driver_link_does_not_crash(tree):
    path = add_amd_gpu(tree, "0000:c1:00.0", driver=None)
    tree.link(f"{path}/driver", "/sys/bus/pci/drivers/gone")  # target never created
    device = devices_of(tree, AMD_GPU)["0000:c1:00.0"]
    assert device.health is Health.UNHEALTHY
    assert "no DRM render node" in device.health_reason


# -- Intel ----------------------------------------------------------------------------------------
def test_intel_resources_split_by_kernel_driver(tree):
    add_intel_gpu(tree, "0000:00:02.0", device=0x4680, pci_class=0x030000, card=0, render=128)
    add_intel_gpu(tree, "0000:03:00.0", device=0xE20B, driver="xe", card=1, render=129)
    found = discover(tree, I915, XE)
    assert [d.id for d in found["gpu.intel.com/i915"]] == ["0000:00:02.0"]
    assert [d.id for d in found["gpu.intel.com/xe"]] == ["0000:03:00.0"]
    xe = found["gpu.intel.com/xe"][0]
    assert xe.healthy, xe.health_reason
    assert node_paths(xe) == ["/dev/dri/card1", "/dev/dri/renderD129"]
    assert xe.mounts == (
        Mount("/dev/dri/by-path/pci-0000:03:00.0-card", "/dev/dri/by-path/pci-0000:03:00.0-card"),
        Mount("/dev/dri/by-path/pci-0000:03:00.0-render",
              "/dev/dri/by-path/pci-0000:03:00.0-render"),
    )


def test_intel_dangling_by_path_link_is_not_mounted(tree):
    add_intel_gpu(tree, "0000:03:00.0", card=1, render=128)
    tree.remove("/dev/dri/card1")
    device = devices_of(tree, I915)["0000:03:00.0"]
    assert device.health_reason == "device node /dev/dri/card1 missing"
    assert [m.host_path for m in device.mounts] == ["/dev/dri/by-path/pci-0000:03:00.0-render"]


def test_intel_npu_and_chipset_functions_are_not_gpus(tree):
    tree.pci_function("0000:00:0b.0", vendor=0x8086, device=0x7D1D, pci_class=0x120000,
                      driver="intel_vpu")
    tree.pci_function("0000:00:14.0", vendor=0x8086, device=0x7E7D, pci_class=0x0C0330,
                      driver="xhci_hcd")
    add_intel_gpu(tree, "0000:00:02.0", pci_class=0x030000, card=0, render=128)
    assert list(devices_of(tree)) == ["0000:00:02.0"]


def test_intel_pf_with_vfs_enabled_is_left_to_its_vfs(tree):
    pf = add_intel_gpu(tree, "0000:4d:00.0", card=1, render=128)
    tree.attr(f"{pf}/sriov_numvfs", "2")
    add_intel_gpu(tree, "0000:4d:00.1", card=2, render=129)
    add_intel_gpu(tree, "0000:4d:00.2", card=3, render=130)
    assert list(devices_of(tree, I915)) == ["0000:4d:00.1", "0000:4d:00.2"]


def test_nvidia_virtual_function_is_skipped(tree):
    add_nvidia_control_nodes(tree)
    pf = add_nvidia_gpu(tree, "0000:18:00.0", minor=0)
    vf = tree.pci_function("0000:18:00.4", vendor=0x10DE, device=0x2330, pci_class=0x030200,
                           driver="nvidia")
    tree.link(f"{vf}/physfn", pf)
    assert list(devices_of(tree, NVIDIA_GPU)) == ["0000:18:00.0"]


# -- what is not a GPU ----------------------------------------------------------------------------
def test_nvswitch_bmc_audio_and_other_vendors_are_not_gpus(tree):
    add_nvidia_control_nodes(tree)
    add_nvidia_gpu(tree, "0000:18:00.0", minor=0)
    tree.pci_function("0000:05:00.0", vendor=0x10DE, device=0x22A3, pci_class=0x068000,
                      driver="nvidia-nvswitch")
    tree.pci_function("0000:18:00.1", vendor=0x10DE, device=0x22BA, pci_class=0x040300,
                      driver="snd_hda_intel")
    tree.pci_function("0000:03:00.0", vendor=0x1A03, device=0x2000, pci_class=0x030000,
                      driver="ast")
    tree.pci_function("0000:04:00.0", vendor=0x102B, device=0x0536, pci_class=0x030000,
                      driver="mgag200")
    tree.pci_function("0000:06:00.0", vendor=0x1DA3, device=0x1020, pci_class=0x120000,
                      driver="habanalabs")
    assert list(devices_of(tree)) == ["0000:18:00.0"]


def test_garbage_class_is_skipped_and_logged(tree, caplog):
    add_nvidia_control_nodes(tree)
    add_nvidia_gpu(tree, "0000:18:00.0", minor=0)
    path = add_nvidia_gpu(tree, "0000:2a:00.0", minor=1)
    tree.attr(f"{path}/class", "0xzz0200")
    with caplog.at_level(logging.WARNING, logger="drivers.gpu.driver"):
        found = devices_of(tree)
    assert list(found) == ["0000:18:00.0"]
    assert "0000:2a:00.0" in caplog.text and "class" in caplog.text


def test_missing_vendor_or_class_file_is_skipped(tree):
    add_nvidia_control_nodes(tree)
    add_nvidia_gpu(tree, "0000:18:00.0", minor=0)
    a = add_nvidia_gpu(tree, "0000:2a:00.0", minor=1)
    b = add_nvidia_gpu(tree, "0000:3a:00.0", minor=2)
    tree.remove(f"{a}/vendor")
    tree.remove(f"{b}/class")
    assert list(devices_of(tree)) == ["0000:18:00.0"]


def test_enable_count_above_one_is_enabled_and_zero_is_not(tree):
    add_nvidia_control_nodes(tree)
    a = add_nvidia_gpu(tree, "0000:18:00.0", minor=0)
    b = add_nvidia_gpu(tree, "0000:2a:00.0", minor=1)
    c = add_nvidia_gpu(tree, "0000:3a:00.0", minor=2)
    tree.attr(f"{a}/enable", "2")
    tree.attr(f"{b}/enable", "0")
    tree.remove(f"{c}/enable")
    found = devices_of(tree, NVIDIA_GPU)
    assert found["0000:18:00.0"].healthy
    assert found["0000:2a:00.0"].health_reason == "PCI function disabled (enable = 0)"
    assert found["0000:3a:00.0"].healthy


# -- NUMA -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("numa_node", "expected"), [(0, (0,)), (1, (1,)), (-1, ()), (None, ()), (7, ())]
)
def test_numa_from_the_function(tree, numa_node, expected):
    add_amd_gpu(tree, "0000:c1:00.0", numa_node=numa_node)
    assert devices_of(tree, AMD_GPU)["0000:c1:00.0"].numa_nodes == expected


def test_numa_garbage_is_unknown(tree):
    path = add_amd_gpu(tree, "0000:c1:00.0", numa_node=0)
    tree.attr(f"{path}/numa_node", "zero")
    assert devices_of(tree, AMD_GPU)["0000:c1:00.0"].numa_nodes == ()


# -- selectors ------------------------------------------------------------------------------------
@pytest.fixture
def mixed(tree) -> FakeTree:
    add_nvidia_control_nodes(tree)
    add_nvidia_gpu(tree, "0000:18:00.0", minor=0, device=0x2330)
    add_nvidia_gpu(tree, "0000:2a:00.0", minor=1, device=0x20B5)
    add_nvidia_gpu(tree, "0001:3a:00.0", minor=2, device=0x1EB8, pci_class=0x030000)
    add_amd_gpu(tree, "0000:c1:00.0", card=1, render=128, pci_class=0x038000)
    add_intel_gpu(tree, "0000:00:02.0", pci_class=0x030000, card=0, render=129)
    return tree


@pytest.mark.parametrize(
    ("selectors", "expected"),
    [
        ({}, ["0000:00:02.0", "0000:18:00.0", "0000:2a:00.0", "0000:c1:00.0", "0001:3a:00.0"]),
        ({"vendor": "0x10de"}, ["0000:18:00.0", "0000:2a:00.0", "0001:3a:00.0"]),
        ({"vendor": "10DE", "device": ["0x20b5", 0x1EB8]}, ["0000:2a:00.0", "0001:3a:00.0"]),
        ({"vendor": 0x1002}, ["0000:c1:00.0"]),
        ({"kernel_driver": "i915"}, ["0000:00:02.0"]),
        ({"kernel_driver": ["amdgpu", "i915"]}, ["0000:00:02.0", "0000:c1:00.0"]),
        ({"pci_address": "2a:00.0"}, ["0000:2a:00.0"]),
        ({"pci_address": ["0001:3a:00.0", "0000:18:00.0"]}, ["0000:18:00.0", "0001:3a:00.0"]),
        ({"class": "0x0302"}, ["0000:18:00.0", "0000:2a:00.0"]),
        ({"class": "03"}, ["0000:00:02.0", "0000:18:00.0", "0000:2a:00.0", "0000:c1:00.0",
                           "0001:3a:00.0"]),
        ({"class": ["0x030000", "0x038000"]}, ["0000:00:02.0", "0000:c1:00.0", "0001:3a:00.0"]),
        ({"vendor": "0x10de", "class": "0x0300"}, ["0001:3a:00.0"]),
        ({"vendor": "0x15b3"}, []),
    ],
)
def test_selectors(mixed, selectors, expected):
    driver = GpuDriver()
    driver.check_selectors(selectors)
    resource = ResourceConfig("example.com/gpu", "gpu", selectors)
    assert sorted(devices_of(mixed, resource)) == expected


@pytest.mark.parametrize(
    ("selectors", "key"),
    [
        ({"vendor": "nvidia"}, "vendor"),
        ({"device": "0x123456"}, "device"),
        ({"class": "0x3"}, "class"),
        ({"class": "0x03zz"}, "class"),
        ({"class": 3}, "class"),
        ({"class": []}, "class"),
        ({"kernel_driver": 5}, "kernel_driver"),
        ({"model": "H100"}, "model"),
    ],
)
def test_bad_selectors_name_the_key(selectors, key):
    with pytest.raises(SelectorError) as error:
        GpuDriver().check_selectors(selectors)
    assert error.value.key == key


def test_no_settings_are_accepted():
    GpuDriver().check_settings({})
    with pytest.raises(SelectorError):
        GpuDriver().check_settings({"shared": True})


# -- passthrough ----------------------------------------------------------------------------------
def test_vfio_bound_gpu_is_only_served_when_its_driver_is_named(tree):
    add_nvidia_control_nodes(tree)
    add_nvidia_gpu(tree, "0000:18:00.0", minor=0)
    path = add_nvidia_gpu(tree, "0000:2a:00.0", minor=None, driver="vfio-pci",
                          information=None, iommu_group=41)
    tree.attr(f"{path}/enable", "0")  # vfio-pci enables it only while a VM holds it
    tree.chardev("/dev/vfio/vfio", 10, 196)
    tree.chardev("/dev/vfio/41", 241, 0)

    assert list(devices_of(tree, NVIDIA_GPU)) == ["0000:18:00.0"]
    assert list(devices_of(tree, ALL)) == ["0000:18:00.0"]

    vm = ResourceConfig("nvidia.com/GH100_H100_SXM5_80GB", "gpu",
                        {"vendor": "0x10de", "kernel_driver": "vfio-pci"})
    found = devices_of(tree, vm)
    assert list(found) == ["0000:2a:00.0"]
    device = found["0000:2a:00.0"]
    assert device.healthy, device.health_reason
    assert node_paths(device) == ["/dev/vfio/vfio", "/dev/vfio/41"]
    assert device.env == {}

    merged = ContainerAllocation(device_nodes=device.device_nodes)
    response = GpuDriver().allocate(vm, [device], merged)
    assert response.envs == {"PCI_RESOURCE_NVIDIA_COM_GH100_H100_SXM5_80GB": "0000:2a:00.0"}
    assert response.device_nodes == device.device_nodes


def test_vfio_group_node_missing_is_unhealthy(tree):
    tree.pci_function("0000:2a:00.0", vendor=0x10DE, device=0x2330, pci_class=0x030200,
                      driver="vfio-pci", iommu_group=41)
    tree.chardev("/dev/vfio/vfio", 10, 196)
    vm = ResourceConfig("example.com/vm-gpu", "gpu", {"kernel_driver": "vfio-pci"})
    device = devices_of(tree, vm)["0000:2a:00.0"]
    assert device.health_reason == "device node /dev/vfio/41 missing"


def test_allocate_leaves_container_gpus_to_the_merge(tree):
    add_nvidia_control_nodes(tree)
    add_nvidia_gpu(tree, "0000:18:00.0", minor=0)
    device = devices_of(tree, NVIDIA_GPU)["0000:18:00.0"]
    merged = ContainerAllocation(envs=dict(device.env), device_nodes=device.device_nodes)
    assert GpuDriver().allocate(NVIDIA_GPU, [device], merged) is merged


def test_kubevirt_env_name():
    name = kubevirt_env_name("nvidia.com/TU104GL_Tesla_T4")
    assert name == "PCI_RESOURCE_NVIDIA_COM_TU104GL_TESLA_T4"


# -- registration ---------------------------------------------------------------------------------
def test_plugin_hook_returns_the_driver():
    drivers = plugin.device_plugin_host_drivers()
    assert [type(d) for d in drivers] == [GpuDriver]
    assert drivers[0].name == "gpu"
    assert drivers[0].subsystems == ("pci", "drm")


def test_default_resources_register_only_with_devices(tree):
    driver = GpuDriver()
    defaults = {r.name: r for r in driver.default_resources()}
    assert set(defaults) == {"nvidia.com/gpu", "amd.com/gpu", "gpu.intel.com/i915",
                             "gpu.intel.com/xe"}
    for resource in defaults.values():
        assert resource.driver == "gpu"
        assert resource.register_when_empty is False
        driver.check_selectors(resource.selectors)

    add_amd_gpu(tree, "0000:c1:00.0")
    add_intel_gpu(tree, "0000:00:02.0", driver="xe", card=0, render=129)
    found = discover(tree, *defaults.values())
    assert {name: [d.id for d in devices] for name, devices in found.items()} == {
        "nvidia.com/gpu": [],
        "amd.com/gpu": ["0000:c1:00.0"],
        "gpu.intel.com/i915": [],
        "gpu.intel.com/xe": ["0000:00:02.0"],
    }


def test_no_gpus_and_no_pci_at_all(tmp_path):
    empty = FakeTree(tmp_path / "empty")
    assert discover(empty, NVIDIA_GPU, AMD_GPU) == {"nvidia.com/gpu": [], "amd.com/gpu": []}


# -- the captured 8-GPU server --------------------------------------------------------------------
@pytest.fixture(scope="module")
def hgx(tmp_path_factory) -> FakeTree:
    return load_machine("gpu-server-8x", tmp_path_factory.mktemp("hgx"))


def test_hgx_has_eight_healthy_gpus_four_per_numa_node(hgx):
    driver = GpuDriver()
    found = driver.discover(HostFS(hgx.root), driver.default_resources())
    gpus: Sequence[Device] = found["nvidia.com/gpu"]
    assert [d.id for d in gpus] == [
        "0000:18:00.0", "0000:2a:00.0", "0000:3a:00.0", "0000:5d:00.0",
        "0000:9a:00.0", "0000:ab:00.0", "0000:ba:00.0", "0000:db:00.0",
    ]
    assert all(d.healthy for d in gpus), [d.health_reason for d in gpus]
    assert [d.numa_nodes for d in gpus] == [(0,)] * 4 + [(1,)] * 4
    assert [d.attributes["device_minor"] for d in gpus] == [str(i) for i in range(8)]
    assert [d.device_nodes[0] for d in gpus] == [
        DeviceNode(f"/dev/nvidia{i}", f"/dev/nvidia{i}", "rw") for i in range(8)
    ]
    for device in gpus:
        assert node_paths(device)[1:] == [  # no /dev/nvidia-modeset by default
            "/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools",
        ]
        assert device.env["NVIDIA_VISIBLE_DEVICES"] == device.attributes["uuid"]
        assert device.attributes["model"] == "NVIDIA H100 80GB HBM3"
        assert device.attributes["local_cpulist"] in ("0-55,112-167", "56-111,168-223")
        assert device.attributes["iommu_group"]
        assert not any(p.startswith(hgx.root) for p in node_paths(device))
    assert len({d.env["NVIDIA_VISIBLE_DEVICES"] for d in gpus}) == 8
    # The NVSwitches, the BMC's VGA and the NICs are no GPU of any vendor.
    assert found["amd.com/gpu"] == []
    assert found["gpu.intel.com/i915"] == [] and found["gpu.intel.com/xe"] == []
    everything = driver.discover(HostFS(hgx.root), [ALL])[ALL.name]
    assert len(everything) == 8


def test_hgx_tree_has_the_pieces_other_drivers_read(hgx):
    host = HostFS(hgx.root)
    assert host.machine_numa_nodes() == (0, 1)
    nvswitches = [a for a in host.listdir("/sys/bus/pci/devices")
                  if host.read(f"/sys/bus/pci/devices/{a}/class") == "0x068000"]
    assert len(nvswitches) == 4
    assert host.resolve("/sys/class/infiniband/mlx5_0") == (
        "/sys/devices/pci0000:15/0000:15:01.0/0000:16:00.0/0000:17:01.0/0000:19:00.0"
        "/infiniband/mlx5_0"
    )
    assert host.pci_ancestor("/sys/class/infiniband/mlx5_7").endswith("/0000:dc:00.0")
    assert host.numa_of("/sys/class/infiniband/mlx5_7") == (1,)
    assert host.read("/sys/class/infiniband/mlx5_0/ports/1/state") == "4: ACTIVE"
    assert host.read("/sys/class/infiniband_verbs/uverbs3/ibdev") == "mlx5_3"
    assert host.read("/sys/class/infiniband_mad/umad3/ibdev") == "mlx5_3"
    assert host.resolve("/sys/class/infiniband_verbs/uverbs3/device") == host.resolve(
        "/sys/bus/pci/devices/0000:5e:00.0")
    for name in ("uverbs0", "uverbs7", "umad0", "rdma_cm"):
        assert host.exists(f"/dev/infiniband/{name}")
    nics = [a for a in host.listdir("/sys/bus/pci/devices")
            if host.read(f"/sys/bus/pci/devices/{a}/vendor") == "0x15b3"]
    assert len(nics) == 8
    assert os.path.isfile(hgx.real("/dev/nvidia-uvm"))


def test_without_procfs_minors_follow_pci_order_only_when_unambiguous(tmp_path):
    """A server captured (or mounted) without /proc/driver/nvidia: 8 GPUs, /dev/nvidia0..7."""
    from device_plugin_host_testing.machines import load_machine

    tree = load_machine("gpu-server-8x", tmp_path / "root")
    tree.remove("/proc/driver/nvidia")
    host = HostFS(str(tmp_path / "root"))
    resource = ResourceConfig("nvidia.com/gpu", "gpu", {"vendor": "0x10de"})
    devices = GpuDriver().discover(host, [resource])["nvidia.com/gpu"]
    assert len(devices) == 8 and all(d.healthy for d in devices)
    by_address = sorted(devices, key=lambda d: d.id)
    assert [d.attributes["device_minor"] for d in by_address] == [str(i) for i in range(8)]
    assert all(d.attributes["device_minor_source"].startswith("PCI address order")
               for d in devices)
    # One node missing: the mapping is no longer certain, so nothing is guessed.
    tree.remove("/dev/nvidia7")
    devices = GpuDriver().discover(host, [resource])["nvidia.com/gpu"]
    assert not any(d.healthy for d in devices)
    assert all("device minor unknown" in d.health_reason for d in devices)
