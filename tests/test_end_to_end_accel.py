"""Accelerator machines served by the real host to the kubelet simulator: a Gaudi node
(accel driver), a Trainium node (neuron driver) and an edge box whose Hailo-8 is served by
the generic pci driver from its example config. Real gRPC over real unix sockets."""

from __future__ import annotations

from pathlib import Path

from device_plugin_host_testing.harness import running_host
from device_plugin_host_testing.machines import load_machine
from host.config import default_config, load_config
from host.config.plugins import load_drivers
from host.sim.kubelet import KubeletSimulator
from host.triggers.uevents import InjectedSource

REPO = Path(__file__).resolve().parents[1]
GAUDI = "habana.ai/gaudi"
NEURON = "aws.amazon.com/neuron"
HAILO = "hailo.ai/npu"


def test_a_gaudi3_pod_gets_each_cards_scale_out_verbs_node_from_its_example_config(
    tmp_path, short_dir, run
):
    """Allocate through the kubelet: the response and the CDI spec the host wrote both carry
    the cards' own /dev/infiniband/uverbsN, never the host NICs' uverbs0/uverbs1."""
    import dataclasses
    import json

    from device_plugin_host_testing.harness import make_config

    load_machine("gaudi3-node", tmp_path / "root")
    registry = load_drivers()
    cdi_dir = tmp_path / "cdi"
    example = load_config(str(REPO / "config" / "examples" / "gaudi3-node.toml"),
                          registry.drivers)
    config = make_config(short_dir, [dataclasses.replace(r, cdi=True) for r in example.resources],
                         host_root=str(tmp_path / "root"), cdi_dir=str(cdi_dir))

    async def scenario():
        sim = KubeletSimulator(short_dir, topology_policy="single-numa-node")
        await sim.start()
        try:
            async with running_host(config, registry.drivers):
                await sim.wait_for(lambda s: s.resources[GAUDI].allocatable == 8,
                                   what="8 Gaudi 3 cards allocatable")
                result = await sim.allocate(GAUDI, 2, pod="train")
                verbs = sorted(d.host_path for d in result.response.devices
                               if d.host_path.startswith("/dev/infiniband/"))
                assert len(verbs) == 2
                assert not set(verbs) & {"/dev/infiniband/uverbs0", "/dev/infiniband/uverbs1"}
                (spec_file,) = cdi_dir.glob("*.json")
                spec = json.loads(spec_file.read_text(encoding="utf-8"))
                in_spec = {n["path"] for d in spec["devices"]
                           for n in d["containerEdits"]["deviceNodes"]}
                assert {f"/dev/infiniband/uverbs{n}" for n in range(2, 10)} <= in_spec
        finally:
            await sim.stop()

    run(scenario())


def test_gaudi_allocation_carries_accel_and_control_nodes_and_a_bad_status_turns_unhealthy(
    tmp_path, short_dir, run
):
    tree = load_machine("gaudi-node", tmp_path / "root")
    registry = load_drivers()
    config = default_config(registry.drivers).with_overrides(
        plugin_dir=short_dir, host_root=str(tmp_path / "root"))
    events = InjectedSource()

    async def scenario():
        sim = KubeletSimulator(short_dir, topology_policy="single-numa-node")
        await sim.start()
        try:
            async with running_host(config, registry.drivers, events) as app:
                await sim.wait_for(lambda s: s.resources[GAUDI].allocatable == 8,
                                   what="8 Gaudi cards allocatable")
                assert "npu.intel.com/accel" not in app.served()
                result = await sim.allocate(GAUDI, 2, pod="train")
                assert len(result.numa_nodes) == 1
                indexes = sorted(int(i) for i in
                                 result.response.envs["HABANA_VISIBLE_DEVICES"].split(","))
                assert sorted(d.host_path for d in result.response.devices) == sorted(
                    [f"/dev/accel/accel{i}" for i in indexes]
                    + [f"/dev/accel/accel_controlD{i}" for i in indexes])
                assert all(d.permissions == "rw" for d in result.response.devices)

                # habanalabs says a card needs a reset; the next scan (the resource's
                # health interval, or any event) makes it Unhealthy for the kubelet.
                tree.attr("/sys/bus/pci/devices/0000:9c:00.0/status", "needs reset")
                events.inject("accel")
                await sim.wait_for(lambda s: "0000:9c:00.0" in s.resources[GAUDI].unhealthy,
                                   what="the card needing a reset is Unhealthy")
                assert sim.resources[GAUDI].allocatable == 7
        finally:
            await sim.stop()

    run(scenario())


def test_neuron_allocation_carries_its_dev_neuron_nodes(tmp_path, short_dir, run):
    tree = load_machine("trainium-node", tmp_path / "root")
    registry = load_drivers()
    config = default_config(registry.drivers).with_overrides(
        plugin_dir=short_dir, host_root=str(tmp_path / "root"))

    async def scenario():
        sim = KubeletSimulator(short_dir)
        await sim.start()
        try:
            async with running_host(config, registry.drivers):
                await sim.wait_for(lambda s: s.resources[NEURON].allocatable == 16,
                                   what="16 Neuron devices allocatable")
                result = await sim.allocate(NEURON, 2, pod="train")
                indexes = [int(i[len("neuron"):]) for i in result.device_ids]
                assert sorted(d.host_path for d in result.response.devices) == sorted(
                    f"/dev/neuron{i}" for i in indexes)
                visible = result.response.envs["AWS_NEURON_VISIBLE_DEVICES"].split(",")
                assert sorted(int(v) for v in visible) == sorted(indexes)
                assert not result.numa_nodes  # the tree proves none

                # GetPreferredAllocation keeps a 4-device pod on devices wired to each other.
                links = {}
                for i in range(16):
                    with open(tree.real(f"/sys/class/neuron_device/neuron{i}/connected_devices"),
                              encoding="utf-8") as handle:
                        peers = handle.read().split(",")
                    links[f"neuron{i}"] = {f"neuron{p.strip()}" for p in peers}
                second = await sim.allocate(NEURON, 4, pod="train-b")
                assert second.preferred is not None and set(second.preferred) == set(
                    second.device_ids)
                picked = list(second.device_ids)
                seen, stack = {picked[0]}, [picked[0]]
                while stack:
                    for other in links[stack.pop()] & set(picked):
                        if other not in seen:
                            seen.add(other)
                            stack.append(other)
                assert seen == set(picked), (picked, "not connected over device links")
        finally:
            await sim.stop()

    run(scenario())


def test_hailo_served_by_the_generic_pci_driver_from_its_example_config(
    tmp_path, short_dir, run
):
    load_machine("edge-npu-box", tmp_path / "root")
    registry = load_drivers()
    config = load_config(str(REPO / "config" / "examples" / "edge-npu.toml"),
                         registry.drivers).with_overrides(
        plugin_dir=short_dir, host_root=str(tmp_path / "root"))

    async def scenario():
        sim = KubeletSimulator(short_dir)
        await sim.start()
        try:
            async with running_host(config, registry.drivers):
                await sim.wait_for(lambda s: s.resources[HAILO].allocatable == 1
                                   and s.resources["gpu.intel.com/i915"].allocatable == 1,
                                   what="the Hailo-8 and the iGPU allocatable")
                result = await sim.allocate(HAILO, 1, pod="detect")
                assert result.device_ids == ["0000:02:00.0"]
                assert [(d.host_path, d.container_path, d.permissions)
                        for d in result.response.devices] == [("/dev/hailo0", "/dev/hailo0", "rw")]
        finally:
            await sim.stop()

    run(scenario())


def test_loading_the_boards_kernel_driver_later_brings_its_node_to_the_kubelet(
    tmp_path, short_dir, run
):
    """hailo_pci loaded after the host started: the PCI bind uevent rescans the pci driver and
    the board appears with the node its driver made (parentless, named by board_location,
    as drivers up to v4.22.0 make it)."""
    from device_plugin_host_testing import fake_pci
    from host.sim.tree import FakeTree

    tree = FakeTree(tmp_path / "root")
    tree.numa_nodes(1)
    function = fake_pci.add_hailo8(tree, "0000:02:00.0", driver=None)
    registry = load_drivers()
    config = load_config(str(REPO / "config" / "examples" / "edge-npu.toml"),
                         registry.drivers).with_overrides(
        plugin_dir=short_dir, host_root=str(tmp_path / "root"))
    events = InjectedSource()

    async def scenario():
        sim = KubeletSimulator(short_dir)
        await sim.start()
        try:
            async with running_host(config, registry.drivers, events):
                await sim.wait_for(lambda s: HAILO in s.resources and s.resources[HAILO].live,
                                   what="hailo.ai/npu registered, empty")
                assert sim.resources[HAILO].allocatable == 0
                fake_pci.load_hailo_driver(tree, function, 0)  # modprobe hailo_pci
                events.inject("pci")  # the bind uevent
                await sim.wait_for(lambda s: s.resources[HAILO].allocatable == 1,
                                   what="the Hailo-8 allocatable once its driver bound")
                result = await sim.allocate(HAILO, 1, pod="detect")
                assert [d.host_path for d in result.response.devices] == ["/dev/hailo0"]
        finally:
            await sim.stop()

    run(scenario())
