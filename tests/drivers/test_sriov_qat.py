"""SR-IOV beyond NICs: QAT VFs (service selectors, PF health), kernel-bound VFs, iommufd, the
SR-IOV device plugin's ``_INFO`` variable, on fake trees in the kernel's QAT layout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence

import pytest

from device_plugin_host_testing.fake_qat import heartbeat_status, qat_pf, remove_debugfs
from device_plugin_host_testing.machines import MACHINES, load_machine
from drivers.sriov.driver import SriovDriver
from drivers.sriov.qat import parse_services
from host.core.allocation import merge
from host.core.driver import SelectorError
from host.core.hostfs import HostFS
from host.core.model import Device, DeviceNode, Health, ResourceConfig
from host.sim.fake_net import sriov_pf, vfio_cdev
from host.sim.tree import FakeTree

REPO = Path(__file__).resolve().parents[2]
CY = "qat.intel.com/cy"


@pytest.fixture
def tree(tmp_path) -> FakeTree:
    tree = FakeTree(tmp_path)
    tree.numa_nodes(2)
    return tree


def discover(tree: FakeTree, selectors: Optional[Mapping[str, object]] = None,
             name: str = CY, settings: Optional[Mapping[str, object]] = None) -> List[Device]:
    driver = SriovDriver()
    selectors = dict(selectors or {})
    driver.check_selectors(selectors)
    driver.check_settings(dict(settings or {}))
    resource = ResourceConfig(name=name, driver="sriov", selectors=selectors,
                              settings=dict(settings or {}))
    return list(driver.discover(HostFS(tree.root), [resource])[name])


def by_id(devices: Sequence[Device]) -> Dict[str, Device]:
    return {d.id: d for d in devices}


def two_endpoints(tree: FakeTree):
    """A crypto endpoint at 6b (VFs 0-1 vfio, 2-3 4xxxvf) and a compression one at 70."""
    cy = qat_pf(tree, "0000:6b:00.0", numvfs=4, vfio=(0, 1), services="sym;asym",
                iommu_group=10, vf_iommu_group=100, cdev_base=0)
    dc = qat_pf(tree, "0000:70:00.0", numvfs=4, vfio=(0, 1), services="dc", numa_node=1,
                iommu_group=20, vf_iommu_group=200, cdev_base=2)
    return cy, dc


# -- layout and modes --------------------------------------------------------------------------
def test_qat_vfs_are_found_with_their_pf_facts(tree: FakeTree) -> None:
    cy, dc = two_endpoints(tree)
    devices = by_id(discover(tree))
    assert list(devices) == cy.vf_addresses + dc.vf_addresses
    assert cy.vf_addresses[0] == "0000:6b:00.1"  # First VF Offset 1, stride 1
    vfio = devices[cy.vf_addresses[0]]
    assert vfio.healthy
    assert vfio.attributes["vf_mode"] == "vfio"
    assert vfio.attributes["qat_services"] == "sym;asym"
    assert vfio.attributes["qat_state"] == "up"
    assert vfio.attributes["qat_heartbeat"] == "ok"
    assert vfio.attributes["pf_kernel_driver"] == "4xxx"
    assert vfio.device_nodes == (DeviceNode("/dev/vfio/vfio"), DeviceNode("/dev/vfio/100"))
    kernel = devices[cy.vf_addresses[2]]
    assert kernel.attributes["vf_mode"] == "kernel"  # 4xxxvf: no netdev, not a NIC
    assert kernel.attributes["kernel_driver"] == "4xxxvf"
    assert kernel.device_nodes == ()
    assert devices[dc.vf_addresses[0]].numa_nodes == (1,)


def test_nic_vf_whose_netdev_moved_into_a_pod_stays_netdevice(tree: FakeTree) -> None:
    pf = sriov_pf(tree, "0000:3b:00.0", numvfs=2, ifname="ens1f0")
    tree.remove(f"{pf.vf_paths[0]}/net")  # the CNI moved ens1f0v0 into a pod
    devices = by_id(discover(tree))
    assert devices[pf.vf_addresses[0]].attributes["vf_mode"] == "netdevice"


# -- selectors ---------------------------------------------------------------------------------
def test_select_by_pf_service_in_any_order(tree: FakeTree) -> None:
    cy, dc = two_endpoints(tree)
    assert [d.id for d in discover(tree, {"qat_services": "sym;asym"})] == cy.vf_addresses
    assert [d.id for d in discover(tree, {"qat_services": "asym;sym"})] == cy.vf_addresses
    assert [d.id for d in discover(tree, {"qat_services": "cy"})] == cy.vf_addresses
    assert [d.id for d in discover(tree, {"qat_services": "dc"})] == dc.vf_addresses
    assert discover(tree, {"qat_services": "sym"}) == []  # a crypto PF is not a sym-only pool
    both = discover(tree, {"qat_services": ["dc", "sym;asym"], "kernel_driver": "vfio-pci"})
    assert [d.id for d in both] == cy.vf_addresses[:2] + dc.vf_addresses[:2]


def test_non_qat_vfs_never_match_a_service(tree: FakeTree) -> None:
    sriov_pf(tree, "0000:3b:00.0", numvfs=2)
    assert discover(tree, {"qat_services": "dc"}) == []


def test_unreadable_services_match_no_service(tree: FakeTree) -> None:
    cy, _ = two_endpoints(tree)
    tree.remove(f"{cy.path}/qat/cfg_services")
    assert discover(tree, {"qat_services": "sym;asym"}) == []
    assert "qat_services" not in by_id(discover(tree))[cy.vf_addresses[0]].attributes


def test_select_by_pf_kernel_driver_and_ids(tree: FakeTree) -> None:
    cy, dc = two_endpoints(tree)
    nvme = sriov_pf(tree, "0000:c1:00.0", vendor=0x144D, device=0xA824, vf_device=0xA824,
                    pci_class=0x010802, numvfs=2, driver="nvme", vf_driver="nvme",
                    ifname=None, vf_ifname=None)
    assert [d.id for d in discover(tree, {"pf_kernel_driver": "nvme"})] == nvme.vf_addresses
    assert [d.id for d in discover(tree, {"pf_kernel_driver": "4xxx", "vendor": "0x8086",
                                          "device": "0x4941"})] == (cy.vf_addresses
                                                                    + dc.vf_addresses)
    nvme_vf = by_id(discover(tree))[nvme.vf_addresses[0]]
    assert nvme_vf.attributes["vf_mode"] == "kernel"
    assert "qat_services" not in nvme_vf.attributes


@pytest.mark.parametrize("value", ["crypto", "sym;zip", ";", 3])
def test_bad_service_selector_names_its_key(value: object) -> None:
    with pytest.raises(SelectorError) as error:
        SriovDriver().check_selectors({"qat_services": value})
    assert error.value.key == "qat_services"


def test_service_parsing() -> None:
    assert parse_services("asym;sym") == parse_services("sym;asym") == parse_services("cy")
    assert parse_services("dc") == frozenset({"dc"})


# -- PF health -----------------------------------------------------------------------------------
def test_failed_heartbeat_makes_the_pfs_vfs_unhealthy_until_it_recovers(tree: FakeTree) -> None:
    cy, dc = two_endpoints(tree)
    heartbeat_status(tree, cy.address, "-1")
    devices = by_id(discover(tree))
    for address in cy.vf_addresses:
        assert devices[address].health is Health.UNHEALTHY
        assert "heartbeat failed" in devices[address].health_reason
        assert "qat_4xxx_0000:6b:00.0/heartbeat/status" in devices[address].health_reason
        assert devices[address].attributes["qat_heartbeat"] == "failed"
    assert all(devices[a].healthy for a in dc.vf_addresses)
    heartbeat_status(tree, cy.address, "0")
    assert all(d.healthy for d in discover(tree))


def test_heartbeat_status_carries_the_kernels_nul(tree: FakeTree) -> None:
    cy, _ = two_endpoints(tree)
    status = heartbeat_status(tree, cy.address, "-1")
    assert Path(tree.real(status)).read_bytes() == b"-1\n\0"
    assert not by_id(discover(tree))[cy.vf_addresses[0]].healthy


def test_no_debugfs_is_unknown_not_unhealthy(tree: FakeTree) -> None:
    cy, _ = two_endpoints(tree)
    remove_debugfs(tree)
    devices = by_id(discover(tree))
    assert devices[cy.vf_addresses[0]].healthy
    assert devices[cy.vf_addresses[0]].attributes["qat_heartbeat"] == "unknown"


def test_pf_down_makes_its_vfs_unhealthy(tree: FakeTree) -> None:
    cy, dc = two_endpoints(tree)
    tree.attr(f"{dc.path}/qat/state", "down")
    devices = by_id(discover(tree))
    assert all("QAT PF 0000:70:00.0 is down" in devices[a].health_reason
               for a in dc.vf_addresses)
    assert all(devices[a].healthy for a in cy.vf_addresses)


def test_qat_problem_adds_to_a_vf_problem(tree: FakeTree) -> None:
    cy, _ = two_endpoints(tree)
    tree.remove("/dev/vfio/100")
    heartbeat_status(tree, cy.address, "-1")
    reason = by_id(discover(tree))[cy.vf_addresses[0]].health_reason
    assert "/dev/vfio/100" in reason and "heartbeat failed" in reason


# -- iommufd -------------------------------------------------------------------------------------
def test_iommufd_resource_gets_the_cdev_and_dev_iommu(tree: FakeTree) -> None:
    cy, _ = two_endpoints(tree)
    devices = by_id(discover(tree, {"kernel_driver": "vfio-pci"}, settings={"iommufd": True}))
    vf = devices[cy.vf_addresses[1]]
    assert vf.healthy
    assert vf.device_nodes == (DeviceNode("/dev/iommu"), DeviceNode("/dev/vfio/devices/vfio1"))
    # A missing legacy group node does not matter to an iommufd user...
    tree.remove("/dev/vfio/101")
    assert by_id(discover(tree, {"kernel_driver": "vfio-pci"},
                          settings={"iommufd": True}))[cy.vf_addresses[1]].healthy
    # ...but it does to a group user.
    assert not by_id(discover(tree, {"kernel_driver": "vfio-pci"}))[cy.vf_addresses[1]].healthy


def test_iommufd_without_the_kernels_cdev_is_unhealthy_with_the_reason(tree: FakeTree) -> None:
    pf = qat_pf(tree, "0000:6b:00.0", numvfs=2, vfio=(0,), vf_iommu_group=100)  # no cdevs
    vf = by_id(discover(tree, settings={"iommufd": True}))[pf.vf_addresses[0]]
    assert vf.health is Health.UNHEALTHY
    assert "CONFIG_VFIO_DEVICE_CDEV" in vf.health_reason
    vfio_cdev(tree, pf.vf_paths[0], 7, dev_node=False)
    vf = by_id(discover(tree, settings={"iommufd": True}))[pf.vf_addresses[0]]
    assert "/dev/vfio/devices/vfio7 is missing" in vf.health_reason
    tree.chardev("/dev/vfio/devices/vfio7", 511, 7)
    assert by_id(discover(tree, settings={"iommufd": True}))[pf.vf_addresses[0]].healthy


def test_bad_settings_name_their_key() -> None:
    for settings, key in (({"iommufd": "yes"}, "iommufd"), ({"device_info": 1}, "device_info"),
                          ({"device_info_dir": "relative"}, "device_info_dir"),
                          ({"devinfo": True}, "devinfo")):
        with pytest.raises(SelectorError) as error:
            SriovDriver().check_settings(settings)
        assert error.value.key == key


# -- allocation ----------------------------------------------------------------------------------
def _allocate(tree: FakeTree, ids: Sequence[str], settings: Optional[dict] = None,
              selectors: Optional[dict] = None):
    driver = SriovDriver()
    resource = ResourceConfig(name=CY, driver="sriov", selectors=dict(selectors or {}),
                              settings=dict(settings or {}))
    devices = by_id(driver.discover(HostFS(tree.root), [resource])[CY])
    chosen = [devices[i] for i in ids]
    return driver.allocate(resource, chosen, merge(chosen))


def test_allocation_carries_the_vfio_group_and_the_info_variable(tree: FakeTree) -> None:
    cy, _ = two_endpoints(tree)
    out = _allocate(tree, [cy.vf_addresses[1], cy.vf_addresses[0], cy.vf_addresses[2]])
    assert [n.host_path for n in out.device_nodes] == ["/dev/vfio/vfio", "/dev/vfio/101",
                                                       "/dev/vfio/100"]
    assert out.envs["PCIDEVICE_QAT_INTEL_COM_CY"] == ",".join(
        [cy.vf_addresses[1], cy.vf_addresses[0], cy.vf_addresses[2]])
    info = json.loads(out.envs["PCIDEVICE_QAT_INTEL_COM_CY_INFO"])
    assert info[cy.vf_addresses[0]] == {
        "generic": {"deviceID": cy.vf_addresses[0]},
        "vfio": {"mount": "/dev/vfio/vfio", "dev-mount": "/dev/vfio/100"},
    }
    assert info[cy.vf_addresses[2]] == {"generic": {"deviceID": cy.vf_addresses[2]}}


def test_iommufd_info_names_the_cdev(tree: FakeTree) -> None:
    cy, _ = two_endpoints(tree)
    out = _allocate(tree, [cy.vf_addresses[0]], {"iommufd": True},
                    {"kernel_driver": "vfio-pci"})
    info = json.loads(out.envs["PCIDEVICE_QAT_INTEL_COM_CY_INFO"])
    assert info[cy.vf_addresses[0]]["vfio"] == {"iommufd": "/dev/iommu",
                                                "dev-mount": "/dev/vfio/devices/vfio0"}


def test_device_info_files_are_written_at_allocate(tree: FakeTree, tmp_path) -> None:
    cy, _ = two_endpoints(tree)
    directory = tmp_path / "devinfo" / "dp"  # created when missing, as the spec asks
    _allocate(tree, [cy.vf_addresses[0]], {"device_info": True,
                                           "device_info_dir": str(directory)})
    path = directory / f"qat.intel.com-cy-{cy.vf_addresses[0]}-device.json"
    assert json.loads(path.read_text()) == {
        "type": "pci", "version": "1.1.0",
        "pci": {"pci-address": cy.vf_addresses[0], "pf-pci-address": cy.address},
    }
    assert (path.stat().st_mode & 0o777) == 0o444
    assert [p.name for p in directory.iterdir()] == [path.name]  # no temporary left behind


def test_unwritable_device_info_dir_fails_the_allocation(tree: FakeTree, tmp_path) -> None:
    cy, _ = two_endpoints(tree)
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(RuntimeError) as error:
        _allocate(tree, [cy.vf_addresses[0]], {"device_info": True,
                                               "device_info_dir": str(blocker / "dp")})
    assert cy.vf_addresses[0] in str(error.value)


# -- the captured QAT node -------------------------------------------------------------------------
def test_qat_node_golden_serves_64_of_each_qat_resource() -> None:
    """The golden is ``discover --json`` of
    testkit/device_plugin_host_testing/machines/qat-node.tree (built by
    tests/resources/gen_qat_node.py) with config/examples/qat-node.toml, kept beside the tree as
    qat-node.discover.json; tests/test_machine_goldens.py requires discover to print exactly it
    (regenerate with tests/resources/regen_goldens.py qat-node, and review the diff)."""
    document = json.loads((MACHINES / "qat-node.discover.json")
                          .read_text())
    assert document["config"] == "config/examples/qat-node.toml"
    golden = document["devices"]
    counts: Dict[str, int] = {}
    for row in golden:
        counts[row["resource"]] = counts.get(row["resource"], 0) + 1
        assert row["health"] == "Healthy"
    assert counts == {"qat.intel.com/cy": 64, "qat.intel.com/dc": 64,
                      "qat.intel.com/cy_kernel": 64}


def test_uio_and_rdma_vfs_info_like_the_sriov_device_plugin(tree: FakeTree) -> None:
    from host.sim.fake_net import rdma_cm, rdma_device

    pf = sriov_pf(tree, "0000:98:00.0", vendor=0x15B3, device=0x101D, vf_device=0x101E,
                  driver="mlx5_core", vf_driver="mlx5_core", numvfs=2, ifname="ens2f0np0",
                  vf_ifname="ens2f0v{index}", vf_offset=2, vf_iommu_group=200)
    rdma_device(tree, pf.vf_paths[0], "mlx5_2", link_layers=("Ethernet",), uverbs=2, umad=2)
    rdma_cm(tree)
    tree.bind_driver(pf.vf_paths[1], "igb_uio")
    tree.attr(f"{pf.vf_paths[1]}/uio/uio3/name", "igb_uio")
    tree.chardev("/dev/uio3", 240, 3)
    out = _allocate(tree, pf.vf_addresses)
    info = json.loads(out.envs["PCIDEVICE_QAT_INTEL_COM_CY_INFO"])
    assert info[pf.vf_addresses[0]]["rdma"] == {
        "uverbs": "/dev/infiniband/uverbs2", "umad": "/dev/infiniband/umad2",
        "rdma_cm": "/dev/infiniband/rdma_cm", "rdma_dev": "mlx5_2"}
    assert info[pf.vf_addresses[1]]["uio"] == {"mount": "/dev/uio3"}


def test_gpu_vfs_for_vms_are_served_on_vfio(tree: FakeTree) -> None:
    """An Intel Data Center GPU Flex 170 (8086:56c0, xe) with SR-IOV on: its VFs (same id)
    bound to vfio-pci for VMs are vfio devices like any other."""
    pf = sriov_pf(tree, "0000:4d:00.0", vendor=0x8086, device=0x56C0, vf_device=0x56C0,
                  pci_class=0x038000, numvfs=4, driver="xe", vf_driver="xe", vfio=(0, 1),
                  ifname=None, vf_ifname=None, vf_offset=1, vf_iommu_group=300)
    devices = by_id(discover(tree, {"pf_kernel_driver": "xe", "kernel_driver": "vfio-pci"},
                             name="gpu.intel.com/flex_vf"))
    assert list(devices) == pf.vf_addresses[:2]
    assert devices[pf.vf_addresses[0]].device_nodes[1] == DeviceNode("/dev/vfio/300")
    kernel = by_id(discover(tree))[pf.vf_addresses[2]]
    assert kernel.attributes["vf_mode"] == "kernel"  # on xe: the gpu driver's business


def test_qat_node_survives_a_capture_with_its_services_heartbeat_and_iommufd_nodes(tmp_path):
    """A captured QAT node is what a bug report carries: it must keep what the sriov driver
    reads (qat/cfg_services and state, the debugfs heartbeat, the vfio cdev nodes), or the
    report shows no devices (every service selector fails) and no failed heartbeat."""
    root = tmp_path / "root"
    original = load_machine("qat-node", root)
    heartbeat_status(original, "0000:6b:00.0", "-1")  # this PF's firmware stopped answering
    env = dict(os.environ, PYTHONPATH=str(REPO))
    captured = tmp_path / "qat.tree"
    result = subprocess.run(
        [sys.executable, "-m", "host", "capture", "--host-root", str(root), "-o", str(captured)],
        capture_output=True, text=True, timeout=120, env=env, cwd=REPO)
    assert result.returncode == 0, result.stderr
    text = captured.read_text(encoding="utf-8")
    recaptured = FakeTree(tmp_path / "recaptured")
    recaptured.load(text)

    config = tmp_path / "qat.toml"  # the example, with iommufd on the dc VFs
    config.write_text((REPO / "config" / "examples" / "qat-node.toml").read_text().replace(
        'qat_services = "dc"\n', 'qat_services = "dc"\n[resource.settings]\niommufd = true\n'))

    def discover(where: Path) -> List[tuple]:
        out = subprocess.run(
            [sys.executable, "-m", "host", "discover", "--host-root", str(where),
             "--config", str(config), "--json"],
            capture_output=True, text=True, timeout=60, env=env, cwd=REPO)
        assert out.returncode == 0, out.stderr
        return [(r["resource"], r["id"], r["health"], r["health_reason"], r["numa_nodes"],
                 [n["host_path"] for n in r["device_nodes"]]) for r in json.loads(out.stdout)]

    before = discover(root)
    assert any(row[2] == "Unhealthy" for row in before)
    assert any("/dev/iommu" in row[5] and row[2] == "Healthy" for row in before)
    assert discover(tmp_path / "recaptured") == before


def test_a_failed_heartbeat_is_one_warning_per_pf_not_one_per_vf_or_scan(tree, caplog) -> None:
    """A QAT PF's own problem reads the same for each of its VFs (64 on a real 4xxx): one
    warning per PF and resource when it starts, nothing while it lasts, again after it
    cleared and came back."""
    import logging

    cy, _ = two_endpoints(tree)
    heartbeat_status(tree, cy.address, "-1")
    driver = SriovDriver()
    resource = ResourceConfig(name=CY, driver="sriov", selectors={})

    def scan() -> List[str]:
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            driver.discover(HostFS(tree.root), [resource])
        return [r.getMessage() for r in caplog.records if "heartbeat" in r.getMessage()]

    first = scan()
    assert len(first) == 1 and "4 VF(s)" in first[0], first
    assert scan() == []
    heartbeat_status(tree, cy.address, "0")
    assert scan() == []
    heartbeat_status(tree, cy.address, "-1")
    assert len(scan()) == 1
