"""NVIDIA MIG: procfs capabilities in nv-caps.c's shapes (host/sim/fake_gpu.py), the three
strategies, the optional NVML view (a stand-in source here: no NVIDIA GPU on this machine),
and a MIG allocation end to end through the kubelet simulator."""

from __future__ import annotations

from typing import Dict, List, Optional

import pytest

from device_plugin_host_testing.harness import kubelet_and_host, make_config
from drivers.gpu.driver import GpuDriver
from drivers.gpu.mig import parse_mig_minors, read_mig_devices
from drivers.gpu.nvml import (
    NvmlMig,
    NvmlView,
    PynvmlSource,
    _gpu_peers,
    normalise_bus_id,
    profile_from_name,
)
from host.core.driver import SelectorError
from host.core.hostfs import HostFS
from host.core.model import Device, ResourceConfig
from host.sim.fake_gpu import (
    add_mig_config_caps,
    add_mig_device,
    add_mig_minors_table,
    add_nvidia_control_nodes,
    add_nvidia_gpu,
    gpu_uuid,
    mig_minor,
)
from host.sim.tree import FakeTree

GPU0, GPU1 = "0000:18:00.0", "0000:2a:00.0"
WHOLE = ResourceConfig("nvidia.com/gpu", "gpu", {"vendor": "0x10de"})


def _resource(name="nvidia.com/gpu", strategy: Optional[str] = None, **selectors) -> ResourceConfig:
    settings = {"mig_strategy": strategy} if strategy else {}
    return ResourceConfig(name, "gpu", {"vendor": "0x10de", **selectors}, settings=settings)


class FixedNvml:
    """An NVML source with a fixed answer (or a failure), standing in for pynvml."""

    def __init__(self, view: Optional[NvmlView] = None, error: Optional[Exception] = None):
        self.view, self.error, self.calls = view, error, 0

    def read(self) -> NvmlView:
        self.calls += 1
        if self.error is not None:
            raise self.error
        assert self.view is not None
        return self.view


@pytest.fixture
def tree(tmp_path) -> FakeTree:
    """GPU minor 0 in MIG mode with two MIG devices (gi1/ci0, gi2/ci0); GPU minor 1 whole."""
    fake = FakeTree(tmp_path / "root")
    fake.numa_nodes(2)
    add_nvidia_control_nodes(fake)
    add_nvidia_gpu(fake, GPU0, minor=0, numa_node=0)
    add_nvidia_gpu(fake, GPU1, minor=1, numa_node=1)
    add_mig_minors_table(fake, gpus=2)
    add_mig_config_caps(fake)
    add_mig_device(fake, 0, 1, 0)
    add_mig_device(fake, 0, 2, 0)
    return fake


def _discover(tree: FakeTree, *resources: ResourceConfig,
              nvml: Optional[FixedNvml] = None) -> Dict[str, List[Device]]:
    driver = GpuDriver(nvml=nvml or FixedNvml(NvmlView(False, "nvidia-ml-py is not installed")))
    found = driver.discover(HostFS(tree.root), resources)
    return {name: list(devices) for name, devices in found.items()}


def test_mig_minors_table_and_access_files_parse_as_the_driver_prints_them(tree):
    table = parse_mig_minors("config 1\nmonitor 2\ngpu0/gi1/access 12\ngpu0/gi1/ci0/access 13\n"
                             "garbage\ngpu1/gi2/access x\n")
    assert table == {(0, 1, None): 12, (0, 1, 0): 13}
    found = read_mig_devices(HostFS(tree.root))
    assert list(found) == [0]
    assert [(d.gi, d.ci, d.gi_cap, d.ci_cap) for d in found[0]] == [
        (1, 0, mig_minor(0, 1), mig_minor(0, 1, 0)), (2, 0, mig_minor(0, 2), mig_minor(0, 2, 0)),
    ]


def test_strategy_none_serves_whole_gpus_and_never_a_gpu_in_mig_mode(tree):
    found = _discover(tree, WHOLE, _resource("x/none", "none"), _resource("x/mixed", "mixed"))
    for name in ("nvidia.com/gpu", "x/none", "x/mixed"):
        assert [d.id for d in found[name]] == [GPU1]


def test_strategy_single_serves_mig_devices_with_their_caps_nodes(tree):
    tree.remove("/proc/driver/nvidia/capabilities/gpu0/mig/gi2")  # one MIG device left
    add_mig_device(tree, 1, 3, 0)  # and GPU 1 in MIG mode too: the rule single wants
    devices = _discover(tree, _resource(strategy="single"))["nvidia.com/gpu"]
    assert [d.id for d in devices] == [f"{GPU0}-gi1-ci0", f"{GPU1}-gi3-ci0"]
    assert all(d.healthy for d in devices), [d.health_reason for d in devices]
    first = devices[0]
    paths = [n.host_path for n in first.device_nodes]
    assert paths[:3] == ["/dev/nvidia0", f"/dev/nvidia-caps/nvidia-cap{mig_minor(0, 1)}",
                         f"/dev/nvidia-caps/nvidia-cap{mig_minor(0, 1, 0)}"]
    assert "/dev/nvidiactl" in paths and "/dev/nvidia-caps/nvidia-cap1" not in paths
    assert first.numa_nodes == (0,)
    assert first.env["NVIDIA_VISIBLE_DEVICES"] == f"MIG-{gpu_uuid(GPU0)}/1/0"
    assert first.attributes["mig_gi"] == "1" and first.attributes["mig_ci"] == "0"
    assert "mig_profile" not in first.attributes  # never guessed without NVML
    assert "would add mig_profile and mig_uuid" in first.attributes["nvml"]


def test_strategy_single_on_a_mixed_node_marks_the_whole_gpu_unhealthy(tree):
    devices = {d.id: d for d in _discover(tree, _resource(strategy="single"))["nvidia.com/gpu"]}
    assert sorted(devices) == [f"{GPU0}-gi1-ci0", f"{GPU0}-gi2-ci0", GPU1]
    assert not devices[GPU1].healthy
    assert 'use "mixed"' in devices[GPU1].health_reason
    assert devices[f"{GPU0}-gi1-ci0"].healthy


def test_without_nvml_mig_devices_serve_under_operator_names_by_parent_and_ids(tree):
    found = _discover(
        tree,
        _resource(strategy="mixed"),
        _resource("example.com/mig-small", mig_parent=GPU0, mig_gi=1),
        _resource("example.com/mig-any", mig_parent=[GPU0.upper(), GPU1]),
        _resource("example.com/mig-ci0", mig_ci=0),
    )
    assert [d.id for d in found["nvidia.com/gpu"]] == [GPU1]
    assert [d.id for d in found["example.com/mig-small"]] == [f"{GPU0}-gi1-ci0"]
    assert len(found["example.com/mig-any"]) == 2
    assert len(found["example.com/mig-ci0"]) == 2


def test_a_missing_cap_node_or_disagreeing_minor_is_unhealthy(tree):
    tree.remove(f"/dev/nvidia-caps/nvidia-cap{mig_minor(0, 1, 0)}")
    tree.attr("/proc/driver/nvidia/capabilities/gpu0/mig/gi2/access",
              "DeviceFileMinor: 99\nDeviceFileMode: 292\nDeviceFileModify: 1\n")
    devices = {d.id: d for d in _discover(tree, _resource(strategy="single"))["nvidia.com/gpu"]}
    assert f"nvidia-cap{mig_minor(0, 1, 0)} missing" in devices[f"{GPU0}-gi1-ci0"].health_reason
    assert "says minor 99 but" in devices[f"{GPU0}-gi2-ci0"].health_reason


def test_access_file_without_minor_falls_back_to_the_table_and_vice_versa(tree):
    tree.attr("/proc/driver/nvidia/capabilities/gpu0/mig/gi1/access", "DeviceFileMode: 292\n")
    devices = _discover(tree, _resource(strategy="single"))["nvidia.com/gpu"]
    assert devices[0].attributes["mig_gi_cap"] == str(mig_minor(0, 1))
    tree.remove("/proc/driver/nvidia-caps/mig-minors")
    devices = _discover(tree, _resource(strategy="single"))["nvidia.com/gpu"]
    assert "has no DeviceFileMinor and" in devices[0].health_reason
    assert devices[1].healthy  # its access file still says its minor


def _nvml_view(**extra) -> NvmlView:
    return NvmlView(
        True, "", {GPU0: True, GPU1: False},
        {(GPU0, 1, 0): NvmlMig("MIG-aaaaaaaa-1111-2222-3333-444444444444", "3g.40gb"),
         (GPU0, 2, 0): NvmlMig("MIG-bbbbbbbb-1111-2222-3333-444444444444", "4g.40gb")},
        {GPU0: {GPU1}, GPU1: {GPU0}}, **extra)


def test_nvml_adds_profiles_and_uuids_and_mig_profile_selects(tree):
    source = FixedNvml(_nvml_view())
    found = _discover(tree, _resource("nvidia.com/mig-3g.40gb", mig_profile="3g.40gb"),
                      _resource(strategy="mixed"), nvml=source)
    (mig,) = found["nvidia.com/mig-3g.40gb"]
    assert mig.attributes["mig_profile"] == "3g.40gb"
    assert mig.env["NVIDIA_VISIBLE_DEVICES"] == "MIG-aaaaaaaa-1111-2222-3333-444444444444"
    assert "nvml" not in mig.attributes
    assert found["nvidia.com/gpu"][0].attributes["nvlink_peers"] == GPU0
    assert source.calls == 1  # one NVML read per scan, shared by every resource


def test_single_with_two_profiles_is_refused_per_device(tree):
    add_mig_device(tree, 1, 3, 0)
    view = _nvml_view()
    view.mig_mode[GPU1] = True
    devices = _discover(tree, _resource(strategy="single"), nvml=FixedNvml(view))
    assert devices["nvidia.com/gpu"]
    assert all("needs one MIG profile" in d.health_reason
               for d in devices["nvidia.com/gpu"] if d.attributes.get("mig_profile"))


def test_nvml_mig_mode_without_instances_still_hides_the_whole_gpu(tree):
    tree.remove("/proc/driver/nvidia/capabilities/gpu0/mig/gi1")
    tree.remove("/proc/driver/nvidia/capabilities/gpu0/mig/gi2")
    assert [d.id for d in _discover(tree, WHOLE)["nvidia.com/gpu"]] == [GPU0, GPU1]
    found = _discover(tree, WHOLE, nvml=FixedNvml(_nvml_view()))
    assert [d.id for d in found["nvidia.com/gpu"]] == [GPU1]


def test_nvml_failure_is_isolated_and_procfs_still_serves(tree, caplog):
    source = FixedNvml(error=RuntimeError("NVML_ERROR_DRIVER_NOT_LOADED"))
    devices = _discover(tree, _resource(strategy="single"), nvml=source)["nvidia.com/gpu"]
    migs = [d for d in devices if "mig_gi" in d.attributes]
    assert len(migs) == 2
    assert "NVML_ERROR_DRIVER_NOT_LOADED" in migs[0].attributes["nvml"]
    assert "NVML source failed" in caplog.text


def test_no_nvidia_gpu_means_nvml_is_never_asked(tmp_path):
    source = FixedNvml(error=AssertionError("must not be called"))
    empty = FakeTree(tmp_path / "root")
    assert _discover(empty, WHOLE, nvml=source) == {"nvidia.com/gpu": []}
    assert source.calls == 0


def test_real_nvml_source_without_the_library_says_how_to_get_it():
    try:
        import pynvml  # type: ignore[import-not-found]  # noqa: F401
    except ImportError:
        view = PynvmlSource().read()
        assert not view.available
        assert "pip install 'device-plugin-host[nvidia]'" in view.reason
    else:  # nvidia-ml-py installed: without libnvidia-ml / a GPU it says why, never raises
        view = PynvmlSource().read()
        assert view.available or view.reason.startswith(("NVML did not initialise", "NVML failed"))


def test_nvml_helpers():
    assert normalise_bus_id(b"00000000:18:00.0") == GPU0
    assert normalise_bus_id("00000001:9A:00.0") == "0001:9a:00.0"
    assert profile_from_name("NVIDIA A100-SXM4-40GB MIG 1g.5gb") == "1g.5gb"
    assert profile_from_name("NVIDIA H100 80GB HBM3 MIG 1g.10gb+me") == "1g.10gb+me"
    assert profile_from_name("NVIDIA H100 80GB HBM3") is None
    # HGX: every GPU's links end at NVSwitches; sharing a switch is one hop.
    peers = _gpu_peers({"a": {"s1", "s2"}, "b": {"s1"}, "c": {"a"}}, {"a", "b", "c"})
    assert peers == {"a": {"b"}, "b": {"a"}, "c": {"a"}}


@pytest.mark.parametrize("value", ["Mixed", "auto", 1])
def test_mig_strategy_setting_is_checked(value):
    with pytest.raises(SelectorError) as caught:
        GpuDriver().check_settings({"mig_strategy": value})
    assert caught.value.key == "mig_strategy"


def test_mig_device_allocation_carries_its_caps_nodes(tree, short_dir, run):
    resource = _resource("nvidia.com/mig-slice", mig_parent=GPU0)
    config = make_config(short_dir, [resource], host_root=tree.root)
    driver = GpuDriver(nvml=FixedNvml(NvmlView(False, "not installed")))

    async def scenario():
        async with kubelet_and_host(config, {"gpu": driver}) as (sim, _app):
            await sim.wait_for(lambda s: s.resources["nvidia.com/mig-slice"].allocatable == 2)
            got = await sim.allocate("nvidia.com/mig-slice", 1, pod="small")
            (device_id,) = got.device_ids
            gi = int(device_id.split("-gi")[1].split("-")[0])
            paths = {d.host_path for d in got.response.devices}
            assert {f"/dev/nvidia-caps/nvidia-cap{mig_minor(0, gi)}",
                    f"/dev/nvidia-caps/nvidia-cap{mig_minor(0, gi, 0)}",
                    "/dev/nvidia0", "/dev/nvidiactl"} <= paths
            assert "/dev/nvidia1" not in paths
            envs = dict(got.response.envs)
            assert envs["NVIDIA_VISIBLE_DEVICES"] == f"MIG-{gpu_uuid(GPU0)}/{gi}/0"

    run(scenario())


class _FakeNvmlLibrary:
    """The handful of pynvml calls nvml._read makes, answering like NVML does on an HGX
    with GPU 0 in MIG mode (two MIG devices, empty slots raising NOT_FOUND) and GPU 1 not
    MIG-capable (NOT_SUPPORTED), each with NVLinks to one NVSwitch. Passed in, not patched."""

    class NVMLError(Exception):
        pass

    NVML_DEVICE_MIG_ENABLE = 1
    NVML_FEATURE_ENABLED = 1
    NVML_NVLINK_MAX_LINKS = 4

    def __init__(self):
        self.gpus = [("00000000:18:00.0", True), ("00000000:2A:00.0", False)]
        self.migs = {0: [(1, 0, "NVIDIA H100 80GB HBM3 MIG 3g.40gb", "MIG-aaaa"), None,
                         (2, 0, "NVIDIA H100 80GB HBM3 MIG 4g.40gb", b"MIG-bbbb")]}

    def nvmlDeviceGetCount(self):
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index):
        return ("gpu", index)

    def nvmlDeviceGetPciInfo(self, handle):
        return type("Pci", (), {"busId": self.gpus[handle[1]][0].encode()})

    def nvmlDeviceGetMigMode(self, handle):
        if not self.gpus[handle[1]][1]:
            raise self.NVMLError("Not Supported")
        return (1, 1)

    def nvmlDeviceGetMaxMigDeviceCount(self, handle):
        return len(self.migs.get(handle[1], []))

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle, slot):
        entry = self.migs[handle[1]][slot]
        if entry is None:
            raise self.NVMLError("Not Found")
        return ("mig", entry)

    def nvmlDeviceGetGpuInstanceId(self, mig):
        return mig[1][0]

    def nvmlDeviceGetComputeInstanceId(self, mig):
        return mig[1][1]

    def nvmlDeviceGetName(self, mig):
        return mig[1][2]

    def nvmlDeviceGetUUID(self, mig):
        return mig[1][3]

    def nvmlDeviceGetNvLinkState(self, handle, link):
        if link >= 2:
            raise self.NVMLError("Invalid Argument")
        return 1

    def nvmlDeviceGetNvLinkRemotePciInfo(self, handle, link):
        return type("Pci", (), {"busId": "00000000:07:00.0"})  # an NVSwitch


def test_nvml_reader_against_nvml_shaped_answers():
    from drivers.gpu.nvml import _read

    view = _read(_FakeNvmlLibrary())
    assert view.available
    assert view.mig_mode == {GPU0: True, GPU1: False}
    assert view.migs == {(GPU0, 1, 0): NvmlMig("MIG-aaaa", "3g.40gb"),
                         (GPU0, 2, 0): NvmlMig("MIG-bbbb", "4g.40gb")}
    assert view.nvlink_peers == {GPU0: {GPU1}, GPU1: {GPU0}}


def test_a_bad_mig_strategy_in_a_config_file_is_one_line(tmp_path):
    from host.config import ConfigError, parse_config

    text = ('[[resource]]\nname = "nvidia.com/gpu"\ndriver = "gpu"\n'
            '[resource.settings]\nmig_strategy = "MIXED"\n')
    with pytest.raises(ConfigError) as caught:
        parse_config(text, "c.toml", {"gpu": GpuDriver()})
    message = str(caught.value)
    assert message.startswith("c.toml: ") and "mig_strategy" in message
    assert "\n" not in message
