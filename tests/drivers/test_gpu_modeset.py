"""/dev/nvidia-modeset is the display interface: handed out only where a resource asks for it
with ``nvidia_modeset = true`` (what libnvidia-container does for the "display" capability,
and nvidia-ctk's CDI spec always does); compute resources get the CUDA nodes only."""

from __future__ import annotations

import pytest

from device_plugin_host_testing.machines import load_machine
from drivers.gpu.driver import GpuDriver
from host.config import ConfigError, parse_config
from host.core.allocation import merge
from host.core.driver import SelectorError
from host.core.hostfs import HostFS
from host.core.model import ResourceConfig
from host.sim.fake_gpu import add_nvidia_control_nodes, add_nvidia_gpu
from host.sim.tree import FakeTree

COMPUTE = ResourceConfig("nvidia.com/gpu", "gpu", {"vendor": "0x10de"})
DISPLAY = ResourceConfig("nvidia.com/display-gpu", "gpu", {"vendor": "0x10de"},
                         settings={"nvidia_modeset": True})
OFF = ResourceConfig("nvidia.com/gpu-off", "gpu", {"vendor": "0x10de"},
                     settings={"nvidia_modeset": False})


def _paths(device):
    return [node.host_path for node in device.device_nodes]


def test_modeset_only_where_the_setting_asks_for_it(tmp_path):
    load_machine("gpu-server-8x", tmp_path / "root")  # has c /dev/nvidia-modeset 195:254
    found = GpuDriver().discover(HostFS(str(tmp_path / "root")), [COMPUTE, DISPLAY, OFF])
    for name in (COMPUTE.name, OFF.name):
        assert len(found[name]) == 8
        assert all("/dev/nvidia-modeset" not in _paths(d) for d in found[name])
        assert all("/dev/nvidiactl" in _paths(d) and "/dev/nvidia-uvm" in _paths(d)
                   for d in found[name])
    display = found[DISPLAY.name]
    assert len(display) == 8
    assert all(_paths(d)[-1] == "/dev/nvidia-modeset" for d in display)
    # What Allocate merges for two GPUs of each resource.
    assert "/dev/nvidia-modeset" not in [n.host_path for n in
                                         merge(found[COMPUTE.name][:2]).device_nodes]
    assert [n.host_path for n in merge(display[:2]).device_nodes].count(
        "/dev/nvidia-modeset") == 1


def test_asking_for_modeset_where_the_node_is_missing_changes_nothing(tmp_path):
    tree = FakeTree(tmp_path / "root")
    tree.numa_nodes(1)
    add_nvidia_control_nodes(tree, modeset=False)  # nvidia-modeset.ko not loaded
    add_nvidia_gpu(tree, "0000:18:00.0", minor=0, numa_node=0)
    [device] = GpuDriver().discover(HostFS(str(tree.root)), [DISPLAY])[DISPLAY.name]
    assert device.healthy and "/dev/nvidia-modeset" not in _paths(device)


def test_the_setting_is_a_boolean():
    driver = GpuDriver()
    driver.check_settings({"nvidia_modeset": True})
    with pytest.raises(SelectorError, match="nvidia_modeset"):
        driver.check_settings({"nvidia_modeset": "yes"})
    text = ('[[resource]]\nname = "nvidia.com/gpu"\ndriver = "gpu"\n'
            '[resource.settings]\nnvidia_modeset = 1\n')
    with pytest.raises(ConfigError, match=r"settings\.nvidia_modeset: expected boolean"):
        parse_config(text, "c.toml", {"gpu": driver})
