"""A device matched by two resources is advertised by one: a config error where a file says
so, the first resource in file order where a hot-plug does."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest

from device_plugin_host_testing.drivers import MemoryDriver, make_devices
from device_plugin_host_testing.harness import kubelet_and_host, make_config, running_host
from host.config import ConfigError, parse_config
from host.config.plugins import load_drivers
from host.core.model import Device, ResourceConfig
from host.sim import fake_gpu
from host.sim.tree import FakeTree

REPO = Path(__file__).resolve().parents[1]

TWO_NVIDIA = textwrap.dedent("""\
    [[resource]]
    name = "nvidia.com/gpu"
    driver = "gpu"
    [resource.selectors]
    vendor = "0x10de"

    [[resource]]
    name = "example.com/training-gpu"
    driver = "gpu"
    {extra}
    [resource.selectors]
    vendor = "0x10de"
    """)


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "host", *args], capture_output=True, text=True,
                          timeout=60, env=env, cwd=REPO)


def _gpu_tree(root: Path) -> FakeTree:
    tree = FakeTree(root)
    tree.numa_nodes(1)
    fake_gpu.add_nvidia_control_nodes(tree)
    fake_gpu.add_nvidia_gpu(tree, "0000:18:00.0", minor=0, numa_node=0)
    fake_gpu.add_nvidia_gpu(tree, "0000:3b:00.0", minor=1, numa_node=0)
    return tree


def test_check_config_finds_two_resources_claiming_the_same_gpus_on_a_host_root(tmp_path):
    _gpu_tree(tmp_path / "root")
    config = tmp_path / "c.toml"
    config.write_text(TWO_NVIDIA.format(extra=""))
    result = _cli("check-config", str(config), "--host-root", str(tmp_path / "root"))
    assert result.returncode == 2, result.stderr
    line = result.stderr.strip()
    assert "Traceback" not in result.stderr and len(line.splitlines()) == 1
    assert f"{config}: resource[1] (example.com/training-gpu).selectors: " in line
    assert "resource[0] (nvidia.com/gpu)" in line
    assert "0000:18:00.0" in line and "0000:3b:00.0" in line
    assert "shared_with" in line

    # Said explicitly: both advertise them.
    config.write_text(TWO_NVIDIA.format(extra='shared_with = ["nvidia.com/gpu"]'))
    result = _cli("check-config", str(config), "--host-root", str(tmp_path / "root"))
    assert result.returncode == 0, result.stderr


def test_check_config_scans_the_host_the_file_names(tmp_path):
    """Without --host-root the scan is of the live host: the file's host_root ("/" unless
    set), as `run` would see it."""
    root = tmp_path / "root"
    _gpu_tree(root)
    config = tmp_path / "c.toml"
    config.write_text(f'[host]\nhost_root = "{root}"\n' + TWO_NVIDIA.format(extra=""))
    result = _cli("check-config", str(config))
    assert result.returncode == 2
    assert "0000:18:00.0" in result.stderr and "nvidia.com/gpu" in result.stderr


def test_run_refuses_to_start_with_overlapping_resources(tmp_path, short_dir):
    root = tmp_path / "root"
    _gpu_tree(root)
    config = tmp_path / "c.toml"
    config.write_text(TWO_NVIDIA.format(extra=""))
    result = _cli("run", "--config", str(config), "--plugin-dir", short_dir, "--host-root",
                  str(root))
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "example.com/training-gpu" in result.stderr and "0000:3b:00.0" in result.stderr
    assert [n for n in os.listdir(short_dir) if n.startswith("dph-")] == []


def test_shared_with_is_validated():
    drivers = load_drivers().with_unavailable()
    base = TWO_NVIDIA.format(extra="shared_with = {}")
    cases = {
        '"nvidia.com/gpu"': "must be an array of resource names, got a string",
        "[1]": "shared_with[0]: must be a resource name (a string), got an integer",
        '["Bad Name"]': "is not a valid resource name",
        '["example.com/training-gpu"]': "names the resource itself",
        '["nvidia.com/gpus"]': 'is not a configured resource (did you mean "nvidia.com/gpu"?)',
    }
    for value, reason in cases.items():
        with pytest.raises(ConfigError) as caught:
            parse_config(base.format(value), "c.toml", drivers)
        assert caught.value.key.startswith("resource[1] (example.com/training-gpu).shared_with")
        assert reason in str(caught.value), value
    config = parse_config(base.format('["nvidia.com/gpu"]'), "c.toml", drivers)
    assert config.resources[1].shared_with == ("nvidia.com/gpu",)


def test_a_hot_plugged_device_both_resources_match_goes_to_the_first_and_warns_once(
        short_dir, run, caplog):
    a, b = "example.com/a", "example.com/b"
    driver = MemoryDriver("m", {a: make_devices("a", 1), b: make_devices("b", 1)})
    config = make_config(short_dir, [ResourceConfig(a, "m"), ResourceConfig(b, "m")])
    shared = Device(id="0000:18:00.0", attributes={"pci_address": "0000:18:00.0"})

    async def scenario():
        async with kubelet_and_host(config, {"m": driver}) as (sim, app):
            driver.devices[a] = [*make_devices("a", 1), shared]
            driver.devices[b] = [*make_devices("b", 1), shared]
            with caplog.at_level(logging.WARNING, logger="host.inventory"):
                await app.rescan()
                await app.rescan()
            await sim.wait_for(lambda s: s.resources[a].capacity == 2)
            assert set(sim.resources[a].devices) == {"a0", "0000:18:00.0"}
            assert set(sim.resources[b].devices) == {"b0"}
            warnings = [r.getMessage() for r in caplog.records if "also claimed" in r.getMessage()]
            assert len(warnings) == 1, warnings
            assert "0000:18:00.0" in warnings[0] and a in warnings[0] and b in warnings[0]
            # The first one loses it (unplugged from its view): the second may have it now.
            driver.devices[a] = make_devices("a", 1)
            await app.rescan()
            await sim.wait_for(lambda s: "0000:18:00.0" in s.resources[b].devices,
                               what="device moved to the second resource")

    run(scenario())


def test_same_pci_function_from_two_drivers_is_one_device(short_dir, run):
    """The same PCI function found by two drivers (a GPU driver and a vfio one, say)."""
    address = "0000:3b:00.0"
    gpu = MemoryDriver("g", {"example.com/gpu": [Device(id="GPU-1234", attributes={
        "pci_address": address})]})
    vfio = MemoryDriver("v", {"example.com/vfio": [Device(id=address, attributes={
        "pci_address": address})]})
    resources = [ResourceConfig("example.com/gpu", "g"), ResourceConfig("example.com/vfio", "v")]
    config = make_config(short_dir, resources)

    async def scenario():
        with pytest.raises(ConfigError, match=r"GPU-1234|0000:3b:00\.0"):
            async with running_host(config, {"g": gpu, "v": vfio}):
                pass
        allowed = replace(config, resources=(
            resources[0], replace(resources[1], shared_with=("example.com/gpu",))))
        async with kubelet_and_host(allowed, {"g": gpu, "v": vfio}) as (sim, _app):
            assert sim.resources["example.com/vfio"].capacity == 1
            assert sim.resources["example.com/gpu"].capacity == 1

    run(scenario())


def test_discover_shows_an_overlapping_device_once_and_says_why(tmp_path):
    root = tmp_path / "root"
    _gpu_tree(root)
    config = tmp_path / "c.toml"
    config.write_text(TWO_NVIDIA.format(extra=""))
    result = _cli("discover", "--json", "--config", str(config), "--host-root", str(root))
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    assert sorted((r["resource"], r["id"]) for r in rows) == [
        ("nvidia.com/gpu", "0000:18:00.0"), ("nvidia.com/gpu", "0000:3b:00.0")]
    assert "also claimed by resource nvidia.com/gpu" in result.stderr


def test_discover_says_a_resource_is_empty_because_the_first_took_its_devices(tmp_path):
    # Its selectors do match: "no match for its selectors" would send the operator the
    # wrong way. The per-resource line names the resource that advertises them.
    root = tmp_path / "root"
    _gpu_tree(root)
    config = tmp_path / "c.toml"
    config.write_text(TWO_NVIDIA.format(extra=""))
    result = _cli("discover", "--config", str(config), "--host-root", str(root))
    assert result.returncode == 0, result.stderr
    line = next(x for x in result.stdout.splitlines()
                if x.startswith("  example.com/training-gpu:"))
    assert "no match for its selectors" not in line, line
    assert "advertised by nvidia.com/gpu" in line and "shared_with" in line, line


def test_slices_of_one_card_in_two_resources_of_one_driver_are_not_an_overlap(short_dir, run):
    """MIG-style: each slice has its own id and its card's pci_address; two profiles on one
    GPU are two resources of one driver, and that is a normal layout."""
    address = "0000:18:00.0"
    small = [Device(id=f"MIG-a{i}", attributes={"pci_address": address}) for i in range(2)]
    large = [Device(id="MIG-b0", attributes={"pci_address": address})]
    driver = MemoryDriver("g", {"example.com/mig-1g": small, "example.com/mig-3g": large})
    config = make_config(short_dir, [ResourceConfig("example.com/mig-1g", "g"),
                                     ResourceConfig("example.com/mig-3g", "g")])

    async def scenario():
        async with kubelet_and_host(config, {"g": driver}) as (sim, _app):
            assert sim.resources["example.com/mig-1g"].capacity == 2
            assert sim.resources["example.com/mig-3g"].capacity == 1

    run(scenario())
