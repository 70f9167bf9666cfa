"""NVIDIA SR-IOV vGPU VFs (vendor-specific VFIO, vGPU 17+) served by the sriov driver to VMs:
the VFs stay on ``nvidia`` and are selected by their vGPU type
(testkit/device_plugin_host_testing/fake_vgpu.py)."""

from __future__ import annotations

from typing import Dict, List, Mapping, Optional

import pytest

from device_plugin_host_testing import fake_vgpu as fv
from drivers.sriov.driver import SriovDriver, extra_info, kubevirt_env_name
from host.core.driver import SelectorError
from host.core.hostfs import HostFS
from host.core.model import Device, Health, ResourceConfig
from host.sim.tree import FakeTree

RESOURCE = "nvidia.com/NVIDIA_L40S-24Q"
KUBEVIRT_ENV = "PCI_RESOURCE_NVIDIA_COM_NVIDIA_L40S-24Q"


@pytest.fixture
def tree(tmp_path) -> FakeTree:
    tree = FakeTree(tmp_path)
    tree.numa_nodes(2)
    return tree


def discover(tree: FakeTree, selectors: Mapping[str, object], name: str = RESOURCE,
             settings: Optional[Mapping[str, object]] = None) -> Dict[str, Device]:
    driver = SriovDriver()
    driver.check_selectors(selectors)
    resource = ResourceConfig(name=name, driver="sriov", selectors=dict(selectors),
                              settings=dict(settings or {}))
    return {d.id: d for d in driver.discover(HostFS(tree.root), [resource])[name]}


def nodes(device: Device) -> List[str]:
    return [n.host_path for n in device.device_nodes]


@pytest.mark.parametrize("spelling", ["NVIDIA L40S-24Q", "NVIDIA_L40S-24Q", "1151", 1151])
def test_vgpu_vfs_of_a_type_are_served_with_the_nodes_a_vm_needs(tree, spelling):
    vfs = fv.l40s_vgpu(tree, vf_types=("1151", "1151", None, None))
    assert vfs[:2] == ["0000:41:00.4", "0000:41:00.5"]
    found = discover(tree, {"vgpu_type": spelling})
    assert list(found) == vfs[:2]
    for index, address in enumerate(vfs[:2]):
        device = found[address]
        assert device.health is Health.HEALTHY, device.health_reason
        assert nodes(device) == ["/dev/vfio/vfio", f"/dev/vfio/{70 + index}"]
        assert device.env == {"PCIDEVICE_NVIDIA_COM_NVIDIA_L40S_24Q": address,
                              KUBEVIRT_ENV: address}
        assert device.attributes["vf_mode"] == "vgpu"
        assert device.attributes["vgpu_type"] == "NVIDIA L40S-24Q"
        assert device.attributes["vgpu_type_id"] == "1151"
        assert device.attributes["kernel_driver"] == "nvidia"
        assert device.numa_nodes == (0,)
        assert extra_info(device)["vfio"] == {"mount": "/dev/vfio/vfio",
                                              "dev-mount": f"/dev/vfio/{70 + index}"}
    assert discover(tree, {"vgpu_type": "NVIDIA L40S-12Q"}) == {}


def test_kubevirt_env_name_is_kubevirts_resource_name_to_env_var():
    assert kubevirt_env_name("nvidia.com/NVIDIA_L40S-24Q") == KUBEVIRT_ENV
    assert kubevirt_env_name("example.org/a.b") == "PCI_RESOURCE_EXAMPLE_ORG_A_B"


def test_a_vf_with_no_type_set_is_unhealthy_with_the_reason(tree):
    vfs = fv.l40s_vgpu(tree, vf_types=("1151", None))
    found = discover(tree, {"vendor": "0x10de"}, name="example.com/l40s-vf")
    assert found[vfs[0]].health is Health.HEALTHY
    device = found[vfs[1]]
    assert device.health is Health.UNHEALTHY
    assert device.health_reason == f"VF {vfs[1]}: no vGPU type set " \
                                   "(nvidia/current_vgpu_type is 0)"
    assert nodes(device) == []


def test_a_missing_group_node_is_unhealthy(tree):
    vfs = fv.l40s_vgpu(tree, vf_types=("1151",))
    tree.remove("/dev/vfio/70")
    device = discover(tree, {"vgpu_type": "NVIDIA L40S-24Q"})[vfs[0]]
    assert device.health is Health.UNHEALTHY
    assert "/dev/vfio/70 is missing" in device.health_reason


def test_iommufd_hands_out_the_vfs_cdev(tree):
    vfs = fv.l40s_vgpu(tree, vf_types=("1151", "1151"))
    found = discover(tree, {"vgpu_type": "NVIDIA L40S-24Q"}, settings={"iommufd": True})
    assert [nodes(found[a]) for a in vfs] == [["/dev/iommu", "/dev/vfio/devices/vfio0"],
                                              ["/dev/iommu", "/dev/vfio/devices/vfio1"]]
    assert all(d.health is Health.HEALTHY for d in found.values())


def test_a_full_card_borrows_a_name_only_where_every_card_agrees(tree):
    """A card whose capacity is used lists no creatable type anywhere: the name comes from
    another card's catalog when no card maps the id to another name."""
    full = fv.l40s_vgpu(tree, "0000:41:00.0", vf_types=("1151", "1151"), full=True)
    fv.l40s_vgpu(tree, "0000:c1:00.0", vf_types=(None,), numa_node=1, vf_iommu_group=90,
                 vfio_dev_base=10)
    assert list(discover(tree, {"vgpu_type": "NVIDIA L40S-24Q"})) == full


def test_card_local_ids_are_never_resolved_from_a_card_that_disagrees(tree):
    full = fv.l40s_vgpu(tree, "0000:41:00.0", vf_types=("1151",), full=True)
    fv.l40s_vgpu(tree, "0000:c1:00.0", vf_types=(None,), numa_node=1, vf_iommu_group=90,
                 creatable={"1151": "NVIDIA L40S-12Q"})
    fv.l40s_vgpu(tree, "0000:e1:00.0", vf_types=(None,), numa_node=1, vf_iommu_group=95,
                 creatable={"1151": "NVIDIA L40S-24Q"})
    assert discover(tree, {"vgpu_type": "NVIDIA L40S-24Q"}) == {}
    assert discover(tree, {"vgpu_type": "NVIDIA L40S-12Q"}) == {}
    by_id = discover(tree, {"vgpu_type": "1151"})
    assert list(by_id) == full and "vgpu_type" not in by_id[full[0]].attributes


def test_a_vfio_pci_gpu_vf_and_a_nic_vf_are_not_vgpus(tree):
    from host.sim.fake_net import sriov_pf

    sriov_pf(tree, "0000:3b:00.0", numvfs=2, vf_iommu_group=30)
    fv.l40s_vgpu(tree, vf_types=("1151",))
    assert list(discover(tree, {"vgpu_type": "1151"})) == ["0000:41:00.4"]


@pytest.mark.parametrize("value", ["", "  ", True])
def test_an_empty_vgpu_type_selector_is_refused(value):
    with pytest.raises(SelectorError) as error:
        SriovDriver().check_selectors({"vgpu_type": value})
    assert error.value.key == "vgpu_type"


# One L40S as sysfs shows it with vGPU 17 after ``sriov-manage -e`` and one VF given a type
# (relative links as the kernel makes them; two of its 32 VFs): held out from the fixture.
L40S_BOX = """\
f /sys/devices/system/node/node0/cpulist "0-31"
f /sys/devices/system/node/possible "0"
f /sys/devices/pci0000:40/0000:40:01.1/0000:41:00.0/vendor "0x10de"
f /sys/devices/pci0000:40/0000:40:01.1/0000:41:00.0/device "0x26b9"
f /sys/devices/pci0000:40/0000:40:01.1/0000:41:00.0/class "0x030200"
f /sys/devices/pci0000:40/0000:40:01.1/0000:41:00.0/numa_node "0"
f /sys/devices/pci0000:40/0000:40:01.1/0000:41:00.0/sriov_totalvfs "32"
f /sys/devices/pci0000:40/0000:40:01.1/0000:41:00.0/sriov_numvfs "32"
f /sys/devices/pci0000:40/0000:40:01.1/0000:41:00.0/nvidia/creatable_vgpu_types \
"ID    : vGPU Name\\n1151 : NVIDIA L40S-24Q"
l /sys/devices/pci0000:40/0000:40:01.1/0000:41:00.0/driver -> ../../../../bus/pci/drivers/nvidia
l /sys/devices/pci0000:40/0000:40:01.1/0000:41:00.0/virtfn0 -> ../0000:41:00.4
l /sys/devices/pci0000:40/0000:40:01.1/0000:41:00.0/virtfn1 -> ../0000:41:00.5
l /sys/bus/pci/devices/0000:41:00.0 -> ../../../devices/pci0000:40/0000:40:01.1/0000:41:00.0
f /sys/devices/pci0000:40/0000:40:01.1/0000:41:00.4/vendor "0x10de"
f /sys/devices/pci0000:40/0000:40:01.1/0000:41:00.4/device "0x26b9"
f /sys/devices/pci0000:40/0000:40:01.1/0000:41:00.4/class "0x030200"
f /sys/devices/pci0000:40/0000:40:01.1/0000:41:00.4/numa_node "0"
f /sys/devices/pci0000:40/0000:40:01.1/0000:41:00.4/nvidia/current_vgpu_type "1151"
f /sys/devices/pci0000:40/0000:40:01.1/0000:41:00.4/nvidia/creatable_vgpu_types \
"ID    : vGPU Name"
l /sys/devices/pci0000:40/0000:40:01.1/0000:41:00.4/physfn -> ../0000:41:00.0
l /sys/devices/pci0000:40/0000:40:01.1/0000:41:00.4/driver -> ../../../../bus/pci/drivers/nvidia
l /sys/devices/pci0000:40/0000:40:01.1/0000:41:00.4/iommu_group -> \
../../../../kernel/iommu_groups/71
l /sys/bus/pci/devices/0000:41:00.4 -> ../../../devices/pci0000:40/0000:40:01.1/0000:41:00.4
f /sys/devices/pci0000:40/0000:40:01.1/0000:41:00.5/vendor "0x10de"
f /sys/devices/pci0000:40/0000:40:01.1/0000:41:00.5/device "0x26b9"
f /sys/devices/pci0000:40/0000:40:01.1/0000:41:00.5/class "0x030200"
f /sys/devices/pci0000:40/0000:40:01.1/0000:41:00.5/numa_node "0"
f /sys/devices/pci0000:40/0000:40:01.1/0000:41:00.5/nvidia/current_vgpu_type "0"
f /sys/devices/pci0000:40/0000:40:01.1/0000:41:00.5/nvidia/creatable_vgpu_types \
"ID    : vGPU Name\\n1151 : NVIDIA L40S-24Q"
l /sys/devices/pci0000:40/0000:40:01.1/0000:41:00.5/physfn -> ../0000:41:00.0
l /sys/devices/pci0000:40/0000:40:01.1/0000:41:00.5/driver -> ../../../../bus/pci/drivers/nvidia
l /sys/devices/pci0000:40/0000:40:01.1/0000:41:00.5/iommu_group -> \
../../../../kernel/iommu_groups/72
l /sys/bus/pci/devices/0000:41:00.5 -> ../../../devices/pci0000:40/0000:40:01.1/0000:41:00.5
c /dev/vfio/vfio 10:196
c /dev/vfio/71 243:0
"""


def test_a_real_l40s_tree_serves_its_configured_vf_to_vms(tree):
    tree.load(L40S_BOX)
    found = discover(tree, {"vgpu_type": "NVIDIA L40S-24Q"})
    assert list(found) == ["0000:41:00.4"]
    device = found["0000:41:00.4"]
    assert device.health is Health.HEALTHY, device.health_reason
    assert nodes(device) == ["/dev/vfio/vfio", "/dev/vfio/71"]
    assert device.env[KUBEVIRT_ENV] == "0000:41:00.4"
