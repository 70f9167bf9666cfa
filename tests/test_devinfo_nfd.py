"""The SR-IOV CNI device-info files and the NFD feature file: units, and end to end through the
kubelet simulator (real gRPC, real PodResources) with the real host and the sriov driver."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

from device_plugin_host_testing.fake_qat import heartbeat_status, qat_pf
from device_plugin_host_testing.harness import make_config
from drivers.sriov.driver import SriovDriver
from host.app import HostApp
from host.core.model import Device, ResourceConfig
from host.outputs import devinfo, nfd
from host.sim.kubelet import KubeletSimulator
from host.sim.tree import FakeTree

CY = "qat.intel.com/cy"


# -- device-info units ---------------------------------------------------------------------------
def test_file_name_follows_the_spec() -> None:
    assert devinfo.file_name("intel.com/sriov", "0000:3b:01.2") == (
        "intel.com-sriov-0000:3b:01.2-device.json")


def test_owned_files_are_told_apart_from_a_longer_resource_name(tmp_path) -> None:
    for resource in ("a.com/x", "a.com/x-y"):
        devinfo.write(str(tmp_path), resource, "0000:01:00.1", devinfo.pci_info("0000:01:00.1"))
    (tmp_path / "unrelated.json").write_text("{}")
    assert list(devinfo.owned(str(tmp_path), "a.com/x")) == ["0000:01:00.1"]
    assert list(devinfo.owned(str(tmp_path), "a.com/x-y")) == ["0000:01:00.1"]
    assert devinfo.owned(str(tmp_path / "missing"), "a.com/x") == {}


def test_stale_files() -> None:
    files = {"a": 100.0, "b": 100.0, "c": 195.0, "gone": 100.0}
    held = {("r", "a")}
    # Unheld and old: b. Unheld but written 5 s ago: c stays. No longer served: gone.
    assert devinfo.stale(files, {"a", "b", "c"}, held, "r", 200.0, 60.0) == ["b", "gone"]
    # The kubelet cannot say: only what is no longer served goes.
    assert devinfo.stale(files, {"a", "b", "c"}, None, "r", 200.0, 60.0) == ["gone"]


# -- NFD units -------------------------------------------------------------------------------------
def _gpu(index: int, **attributes: str) -> Device:
    base = {"vendor": "0x10de", "device": "0x2330"}
    base.update(attributes)
    return Device(id=f"gpu{index}", attributes=base)


def test_labels_from_attributes_where_present() -> None:
    gpus = [_gpu(i, product_name="NVIDIA H100 80GB HBM3", memory_bytes=str(85520809984),
                 partition_mode="SPX") for i in range(8)]
    labels = nfd.resource_labels("nvidia.com/gpu", gpus)
    assert labels == {
        "nvidia.com/gpu.count": "8",
        "nvidia.com/gpu.vendor": "10de",
        "nvidia.com/gpu.device": "2330",
        "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
        "nvidia.com/gpu.memory": "81559",
        "nvidia.com/gpu.partition_mode": "SPX",
    }
    # Attributes no driver set are not guessed.
    assert nfd.resource_labels("example.com/x", [Device(id="a")]) == {"example.com/x.count": "1"}
    assert nfd.resource_labels("example.com/x", []) == {"example.com/x.count": "0"}


def test_mixed_devices_and_unsafe_values() -> None:
    devices = [_gpu(0, memory_bytes="2147483648"), _gpu(1, device="0x20b5",
                                                       memory_bytes="1073741824")]
    labels = nfd.resource_labels("nvidia.com/gpu", devices)
    assert labels["nvidia.com/gpu.device"] == "20b5_2330"
    assert labels["nvidia.com/gpu.memory"] == "1024"  # the smallest a pod can be given
    assert nfd.label_value("  Instinct MI300X (OAM) / rev 1 ") == "Instinct-MI300X-OAM-rev-1"
    assert len(nfd.label_value("x" * 80)) == 63


def test_label_name_too_long_is_left_out() -> None:
    text = nfd.render({"example.com/" + "n" * 60: [Device(id="a")]})
    assert "=" not in text.replace("# ", "")


def test_feature_file_written_atomically_only_on_change_and_removed(tmp_path) -> None:
    path = tmp_path / "features.d" / "device-plugin-host"
    feature = nfd.FeatureFile(str(path))
    feature.update("example.com/x", [Device(id="a")])
    assert not feature.flush()  # NFD's directory does not exist: nothing created
    assert not path.parent.exists()
    path.parent.mkdir()
    assert feature.flush()
    assert "example.com/x.count=1\n" in path.read_text()
    inode = path.stat().st_ino
    feature.update("example.com/x", [Device(id="a")])
    assert not feature.flush()  # same text: not rewritten
    assert path.stat().st_ino == inode
    feature.update("example.com/x", [Device(id="a"), Device(id="b")])
    assert feature.flush()
    assert "example.com/x.count=2\n" in path.read_text()
    assert [p.name for p in path.parent.iterdir()] == ["device-plugin-host"]
    feature.remove()
    assert not path.exists()


def test_feature_file_stays_under_nfds_size_limit() -> None:
    many = {f"example.com/r{i}": [Device(id="a", attributes={"vendor": "0x1234"})]
            for i in range(3000)}
    assert len(nfd.render(many).encode()) <= nfd.MAX_BYTES


# -- end to end ----------------------------------------------------------------------------
def _node(root: str) -> FakeTree:
    tree = FakeTree(root)
    tree.numa_nodes(2)
    qat_pf(tree, "0000:6b:00.0", numvfs=4, vfio=(0, 1, 2), services="sym;asym",
           iommu_group=10, vf_iommu_group=100)
    return tree


@contextlib.asynccontextmanager
async def quiet_host(config):
    """The real host, its device-info reconciler left to the test's explicit passes."""
    app = HostApp(config, {"sriov": SriovDriver()}, events=None)
    app.devinfo.first_pass_s = app.devinfo.interval_s = 3600.0
    await app.start()
    try:
        yield app
    finally:
        await app.stop()


def test_qat_vf_allocation_device_info_file_and_node_labels(short_dir, tmp_path, run) -> None:
    _node(str(tmp_path / "root"))
    info_dir = tmp_path / "devinfo" / "dp"
    features = tmp_path / "features.d" / "device-plugin-host"
    features.parent.mkdir()
    pod_socket = os.path.join(short_dir, "pr", "kubelet.sock")
    resource = ResourceConfig(
        CY, "sriov", selectors={"kernel_driver": "vfio-pci", "qat_services": "sym;asym"},
        settings={"device_info": True, "device_info_dir": str(info_dir)})
    config = make_config(short_dir, [resource], host_root=str(tmp_path / "root"),
                         pod_resources_socket=pod_socket, nfd_features_file=str(features))

    async def scenario() -> None:
        sim = KubeletSimulator(short_dir, pod_resources_socket=pod_socket)
        await sim.start()
        try:
            async with quiet_host(config) as app:
                await sim.wait_for(lambda k: CY in k.resources
                                   and k.resources[CY].allocatable == 3, what="3 QAT VFs")
                labels = features.read_text()
                assert f"{CY}.count=3\n" in labels and f"{CY}.device=4941\n" in labels

                first = await sim.allocate(CY, 1, pod="crypto")
                (vf,) = first.device_ids
                nodes = [d.host_path for d in first.response.devices]
                assert nodes[0] == "/dev/vfio/vfio" and nodes[1].startswith("/dev/vfio/10")
                env = dict(first.response.envs)
                assert env["PCIDEVICE_QAT_INTEL_COM_CY"] == vf
                assert json.loads(env["PCIDEVICE_QAT_INTEL_COM_CY_INFO"])[vf]["vfio"][
                    "dev-mount"] == nodes[1]
                path = info_dir / devinfo.file_name(CY, vf)
                assert json.loads(path.read_text())["pci"] == {
                    "pci-address": vf, "pf-pci-address": "0000:6b:00.0"}

                app.devinfo.grace_s = 0.0
                assert app.devinfo._task is not None  # the reconciler runs while served
                assert await app.devinfo.reconcile() == []  # held: it stays
                assert path.exists()
                sim.release("crypto")
                assert await app.devinfo.reconcile() == [str(path)]
                assert not path.exists()

                # The kubelet away: nothing is removed for being unheld.
                second = await sim.allocate(CY, 1, pod="again")
                kept = info_dir / devinfo.file_name(CY, second.device_ids[0])
                sim.release("again")
                assert sim.pod_resources is not None
                await sim.pod_resources.stop()
                assert await app.devinfo.reconcile() == []
                assert kept.exists()
                await sim.pod_resources.start()

                # A failed heartbeat: the VFs go Unhealthy, the labels keep counting them.
                heartbeat_status(FakeTree(str(tmp_path / "root")), "0000:6b:00.0", "-1")
                await app.rescan()
                await sim.wait_for(lambda k: k.resources[CY].allocatable == 0,
                                   what="VFs unhealthy")
                assert f"{CY}.count=3\n" in features.read_text()
                heartbeat_status(FakeTree(str(tmp_path / "root")), "0000:6b:00.0", "0")
                await app.rescan()
                await sim.wait_for(lambda k: k.resources[CY].allocatable == 3,
                                   what="VFs healthy again")
                held = await sim.allocate(CY, 1, pod="long-running")
            # Stopped: every file of ours is gone.
            assert not kept.exists()
            assert not features.exists()
            assert list(info_dir.iterdir()) == []
            # A new host while the pod still holds its VF: its first pass writes the file back.
            async with quiet_host(config) as app:
                assert await app.devinfo.reconcile() == []
                restored = info_dir / devinfo.file_name(CY, held.device_ids[0])
                assert json.loads(restored.read_text())["pci"]["pci-address"] == \
                    held.device_ids[0]
                assert features.exists()
        finally:
            await sim.stop()

    run(scenario())


def test_reload_that_drops_device_info_removes_the_files(short_dir, tmp_path, run) -> None:
    _node(str(tmp_path / "root"))
    info_dir = tmp_path / "dp"
    settings = {"device_info": True, "device_info_dir": str(info_dir)}
    resource = ResourceConfig(CY, "sriov", selectors={"kernel_driver": "vfio-pci"},
                              settings=settings)
    config = make_config(short_dir, [resource], host_root=str(tmp_path / "root"))

    async def scenario() -> None:
        sim = KubeletSimulator(short_dir)
        await sim.start()
        try:
            async with quiet_host(config) as app:
                await sim.wait_for(lambda k: CY in k.resources
                                   and k.resources[CY].allocatable == 3, what="3 VFs")
                await sim.allocate(CY, 2, pod="p")
                assert len(list(info_dir.iterdir())) == 2
                plain = ResourceConfig(CY, "sriov", selectors={"kernel_driver": "vfio-pci"})
                await app.reload(make_config(short_dir, [plain],
                                             host_root=str(tmp_path / "root")))
                assert list(info_dir.iterdir()) == []
        finally:
            await sim.stop()

    run(scenario())


def test_files_of_a_previous_run_are_adopted_and_reconciled(tmp_path, run) -> None:
    directory = str(tmp_path)
    devinfo.write(directory, CY, "0000:6b:00.1", devinfo.pci_info("0000:6b:00.1"))
    resource = ResourceConfig(CY, "sriov", settings={"device_info": True,
                                                     "device_info_dir": directory})

    async def held() -> devinfo.Held:
        return set()

    reconciler = devinfo.DeviceInfoReconciler(
        lambda: [resource], lambda name: [Device(id="0000:6b:00.1")], held, grace_s=0.0)
    removed = run(reconciler.reconcile())
    assert removed == [str(Path(directory) / devinfo.file_name(CY, "0000:6b:00.1"))]


def test_nfd_features_file_setting_is_validated() -> None:
    import pytest

    from host.config import ConfigError, parse_config

    drivers = {"sriov": SriovDriver()}
    assert parse_config('[host]\nnfd_features_file = ""\n', "f", drivers).host \
        .nfd_features_file == ""
    for bad in ('"features.d/x"', '"/etc/kubernetes/features.d/"', "3"):
        with pytest.raises(ConfigError) as error:
            parse_config(f"[host]\nnfd_features_file = {bad}\n", "f", drivers)
        assert error.value.key == "host.nfd_features_file"


def test_a_file_allocate_rewrites_during_a_pass_is_kept(tmp_path, run) -> None:
    """Allocate runs off the loop while a pass awaits the kubelet: the file it writes then
    must not be judged by an answer that predates it (fails if the files are listed before
    the kubelet answers)."""
    directory = str(tmp_path)
    path = devinfo.write(directory, CY, "0000:6b:00.1", devinfo.pci_info("0000:6b:00.1"))
    os.utime(path, (1, 1))  # a file of a pod long gone
    resource = ResourceConfig(CY, "sriov", settings={"device_info": True,
                                                     "device_info_dir": directory})

    async def held_while_allocate_writes() -> devinfo.Held:
        devinfo.write(directory, CY, "0000:6b:00.1", devinfo.pci_info("0000:6b:00.1"))
        return set()  # the kubelet's answer does not know the new pod yet

    reconciler = devinfo.DeviceInfoReconciler(
        lambda: [resource], lambda name: [Device(id="0000:6b:00.1")],
        held_while_allocate_writes)
    assert run(reconciler.reconcile()) == []
    assert os.path.exists(path)


def test_rescans_coalesce_into_one_deferred_write(tmp_path, run) -> None:
    import asyncio

    path = tmp_path / "features.d" / "device-plugin-host"
    path.parent.mkdir()

    class Watched(nfd.FeatureFile):
        def __init__(self) -> None:
            super().__init__(str(path), delay_s=0.01)
            self.writes = 0
            self.flushed = asyncio.Event()

        def flush(self) -> bool:
            wrote = super().flush()
            self.writes += wrote
            self.flushed.set()
            return wrote

    async def scenario() -> None:
        feature = Watched()
        for count in range(1, 6):  # a burst of five rescans
            feature.update("example.com/x", [Device(id=str(i)) for i in range(count)])
            feature.schedule()
        assert not path.exists()  # nothing on the push path itself
        await asyncio.wait_for(feature.flushed.wait(), 5)
        assert feature.writes == 1
        assert "example.com/x.count=5\n" in path.read_text()
        feature.update("example.com/x", [Device(id="0")])
        feature.schedule()
        feature.remove()  # stop: the pending write is cancelled and the file goes
        assert not path.exists()

    run(scenario())


def test_an_nfd_features_file_that_names_a_directory_is_a_config_error(tmp_path):
    """NFD's docs name the features.d *directory*; an operator who writes that path would
    get a file that is never written (a rename onto a directory fails at every change)."""
    import pytest

    from host.config import ConfigError, parse_config

    features_d = tmp_path / "features.d"
    features_d.mkdir()
    with pytest.raises(ConfigError) as error:
        parse_config(f'[host]\nnfd_features_file = "{features_d}"\n', "c.toml", {})
    message = str(error.value)
    assert "host.nfd_features_file" in message and "directory" in message, message
    parse_config(f'[host]\nnfd_features_file = "{features_d}/device-plugin-host"\n', "c.toml", {})
