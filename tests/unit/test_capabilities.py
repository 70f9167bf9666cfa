"""Optional driver capabilities (host/core/capabilities.py): a driver has one exactly when it
defines the method, whether it subclasses Driver or not, and the host detects them once per
driver."""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass
from typing import List, Mapping, Optional, Sequence

import pytest

import device_plugin_host
from device_plugin_host_testing.drivers import ReversePreferenceDriver, make_devices
from drivers.fpga.driver import FpgaDriver
from drivers.gpu.driver import GpuDriver
from drivers.neuron.driver import NeuronDriver
from drivers.sriov.driver import SriovDriver
from drivers.usb.driver import UsbDriver
from host.config.defaults import default_config
from host.config.errors import ConfigError
from host.config.resources import parse_resource
from host.core import capabilities as caps
from host.core.capabilities import (
    Allocator,
    Capabilities,
    ContainerPreStarter,
    DeviceDriver,
    PreferredAllocator,
    config_checks,
    default_resources,
    needs_pre_start,
    preferred_useful,
)
from host.core.driver import Driver, SelectorError, UnavailableDriver
from host.core.hostfs import HostFS
from host.core.isolation import DriverCalls
from host.core.model import ContainerAllocation, Device, PreferredRequest, ResourceConfig
from host.kubelet.service import DevicePluginService, preferred_allocation_useful
from host.kubelet.snapshot import Snapshot

RESOURCE = ResourceConfig("example.com/thing", "duck")
WITH_STEP = ResourceConfig("example.com/thing", "duck", settings={"step": True})
OPTIONAL = ("allocate", "preferred", "preferred_useful", "pre_start", "needs_pre_start")


class Plain(Driver):
    name = "plain"

    def scan(self, host: HostFS) -> List[Device]:
        return []


class Duck:
    """A third-party driver that does not subclass Driver: name and discover only."""

    name = "duck"
    subsystems = ("usb",)

    def __init__(self) -> None:
        self.pre_starts: List[List[str]] = []

    def discover(self, host: HostFS, resources: Sequence[ResourceConfig]
                 ) -> Mapping[str, Sequence[Device]]:
        return {r.name: make_devices("d", 2) for r in resources}


class DuckWithPreStart(Duck):
    def pre_start(self, resource: ResourceConfig, devices: Sequence[Device]) -> None:
        self.pre_starts.append([d.id for d in devices])


class DuckWithGate(DuckWithPreStart):
    def needs_pre_start(self, resource: ResourceConfig) -> bool:
        return bool(resource.settings.get("step"))


class DuckWithEverything(DuckWithGate):
    selector_types = {"tag": (str,)}

    def allocate(self, resource: ResourceConfig, devices: Sequence[Device],
                 merged: ContainerAllocation) -> ContainerAllocation:
        return merged

    def preferred(self, resource: ResourceConfig, request: PreferredRequest
                  ) -> Optional[Sequence[str]]:
        return None

    def preferred_useful(self, resource: ResourceConfig, devices: Sequence[Device]) -> bool:
        return len(devices) > 3

    def check_selectors(self, selectors: Mapping[str, object]) -> None:
        if "tag" not in selectors:
            raise SelectorError("tag", "required")

    def check_settings(self, settings: Mapping[str, object]) -> None:
        pass

    def default_resources(self) -> Sequence[ResourceConfig]:
        return (ResourceConfig("example.com/duck", "duck", {"tag": "a"}),)


class SubclassPreferring(Plain):
    def preferred(self, resource: ResourceConfig, request: PreferredRequest
                  ) -> Optional[Sequence[str]]:
        return [d.id for d in request.available][: request.size]


def test_the_base_class_defines_no_optional_capability():
    for name in OPTIONAL:
        assert not hasattr(Driver, name), name
    record = Capabilities.of(Plain())
    assert record == Capabilities(check_selectors=True, check_settings=True,
                                  default_resources=True)
    assert isinstance(Plain(), DeviceDriver)
    assert not isinstance(Plain(), (Allocator, PreferredAllocator, ContainerPreStarter))
    assert Capabilities.of(UnavailableDriver("gone", "import failed")) == record


def test_a_subclass_has_what_it_defines():
    record = Capabilities.of(SubclassPreferring())
    assert record.preferred and not record.preferred_gate
    assert not record.allocate and not record.pre_start
    # A policy without a gate always counts; a policy's absence never does.
    assert preferred_useful(SubclassPreferring(), RESOURCE, [])
    assert not preferred_useful(Plain(), RESOURCE, make_devices("d", 4, (0, 1)))
    # The NUMA rule still applies to a driver without a policy.
    assert preferred_allocation_useful(RESOURCE, Plain(), make_devices("d", 4, (0, 1)))
    assert not preferred_allocation_useful(RESOURCE, Plain(), make_devices("d", 4, (0,)))
    assert preferred_allocation_useful(RESOURCE, SubclassPreferring(), make_devices("d", 4, (0,)))
    assert preferred_allocation_useful(RESOURCE, ReversePreferenceDriver("m"), [])


def test_the_built_in_drivers_capabilities():
    gpu = Capabilities.of(GpuDriver())
    assert gpu.allocate and gpu.preferred and gpu.preferred_gate and not gpu.pre_start
    neuron = Capabilities.of(NeuronDriver())
    assert neuron.preferred and neuron.preferred_gate and not neuron.allocate
    fpga = Capabilities.of(FpgaDriver())
    assert fpga.pre_start and fpga.pre_start_gate and not fpga.preferred
    sriov = Capabilities.of(SriovDriver())
    assert sriov.allocate and not sriov.preferred and not sriov.pre_start
    usb = Capabilities.of(UsbDriver())
    assert not (usb.allocate or usb.preferred or usb.pre_start or usb.pre_start_gate)


def test_a_duck_typed_driver_without_optional_methods():
    duck = Duck()
    assert isinstance(duck, DeviceDriver)
    assert Capabilities.of(duck) == Capabilities()
    assert not needs_pre_start(duck, RESOURCE)
    assert not preferred_useful(duck, RESOURCE, make_devices("d", 4))
    assert default_resources(duck) == ()
    check_selectors, check_settings = config_checks(duck)
    check_selectors({})
    check_settings({})
    with pytest.raises(SelectorError, match="unknown selector for driver 'duck'"):
        check_selectors({"tag": "a"})
    with pytest.raises(SelectorError, match="unknown setting for driver 'duck'"):
        check_settings({"mode": "a"})


def test_a_duck_typed_driver_with_pre_start_and_with_its_gate():
    assert needs_pre_start(DuckWithPreStart(), RESOURCE)
    assert not Capabilities.of(DuckWithPreStart()).pre_start_gate
    assert not needs_pre_start(DuckWithGate(), RESOURCE)
    assert needs_pre_start(DuckWithGate(), WITH_STEP)


def test_a_duck_typed_driver_with_every_capability():
    duck = DuckWithEverything()
    assert Capabilities.of(duck) == Capabilities(*[True] * 8)
    assert not preferred_useful(duck, RESOURCE, make_devices("d", 3))
    assert preferred_useful(duck, RESOURCE, make_devices("d", 4))
    assert default_resources(duck) == duck.default_resources()
    check_selectors, _ = config_checks(duck)
    with pytest.raises(SelectorError, match="required"):
        check_selectors({})


def _service(driver: object, resource: ResourceConfig = RESOURCE) -> DevicePluginService:
    snapshot = Snapshot()
    snapshot.update(make_devices("d", 2))
    return DevicePluginService(resource, driver, snapshot, DriverCalls(),  # type: ignore[arg-type]
                               allocate_timeout_s=5)


def test_the_service_options_of_duck_typed_drivers(caplog):
    caplog.set_level(logging.ERROR)
    assert not _service(Duck()).options.pre_start_required
    assert _service(DuckWithPreStart()).options.pre_start_required
    assert not _service(DuckWithGate()).options.pre_start_required
    gated = _service(DuckWithGate(), WITH_STEP)
    assert gated.options.pre_start_required
    assert gated.needs_options_change(RESOURCE, DuckWithGate())  # type: ignore[arg-type]
    assert not gated.needs_options_change(WITH_STEP, DuckWithGate())  # type: ignore[arg-type]
    assert not _service(Duck()).options.get_preferred_allocation_available
    assert caplog.records == []  # a missing method is no failure


def test_a_failing_gate_is_logged_and_means_no_pre_start(caplog):
    class Broken(DuckWithPreStart):
        def needs_pre_start(self, resource: ResourceConfig) -> bool:
            raise RuntimeError("cannot tell")

    assert not _service(Broken()).options.pre_start_required
    assert "needs_pre_start failed: cannot tell" in caplog.text


def test_duck_typed_config_checks_and_defaults_through_the_loaders():
    entry = {"name": "example.com/duck", "driver": "duck", "selectors": {"tag": "a"}}
    with pytest.raises(ConfigError, match="unknown selector"):
        parse_resource("c.toml", 0, entry, {"duck": Duck()}, ())  # type: ignore[dict-item]
    parsed = parse_resource("c.toml", 0, entry, {"duck": DuckWithEverything()},  # type: ignore[dict-item]
                            ())
    assert parsed.selectors == {"tag": "a"}
    assert default_config({"duck": Duck()}).resources == ()  # type: ignore[dict-item]
    (served,) = default_config({"duck": DuckWithEverything()}).resources  # type: ignore[dict-item]
    assert served.name == "example.com/duck" and not served.register_when_empty


def test_the_record_is_detected_once_per_driver_object():
    class Growing(Duck):
        pass

    driver = Growing()
    first = Capabilities.of(driver)
    Growing.pre_start = DuckWithPreStart.pre_start  # type: ignore[attr-defined]
    assert Capabilities.of(driver) is first and not first.pre_start
    assert Capabilities.of(Growing()).pre_start  # a new object is looked at anew
    key = id(driver)
    assert key in caps._records
    del driver
    gc.collect()
    assert key not in caps._records


def test_drivers_that_cannot_be_weakly_referenced_or_hashed():
    class Slotted:
        __slots__ = ()
        name = "slotted"

        def discover(self, host, resources):
            return {}

        def pre_start(self, resource, devices):
            pass

    @dataclass
    class Unhashable(Duck):
        name: str = "unhashable"

        def allocate(self, resource, devices, merged):
            return merged

    assert Capabilities.of(Slotted()).pre_start
    assert Capabilities.of(Unhashable()).allocate


def test_the_protocols_are_public():
    for name in ("DeviceDriver", "Allocator", "PreferredAllocator", "PreferredGate",
                 "ContainerPreStarter", "PreStartGate", "SelectorChecker", "SettingsChecker",
                 "DefaultsProvider", "Capabilities"):
        assert getattr(device_plugin_host, name) is getattr(caps, name)
        assert name in device_plugin_host.__all__
    assert not hasattr(device_plugin_host, "implements")


def test_a_duck_typed_driver_served_to_the_kubelet(short_dir, run):
    """Loaded as a third party's driver would be: its pre_start runs before the container
    starts, and it has no allocate hook and no preferred policy of its own."""
    from device_plugin_host_testing.harness import kubelet_and_host, make_config

    duck = DuckWithPreStart()

    async def scenario():
        config = make_config(short_dir, [RESOURCE])
        async with kubelet_and_host(config, {"duck": duck}) as (sim, _app):  # type: ignore[dict-item]
            await sim.wait_for(lambda s: RESOURCE.name in s.resources
                               and s.resources[RESOURCE.name].live, what="registered")
            options = sim.resources[RESOURCE.name].options
            assert options.pre_start_required
            assert not options.get_preferred_allocation_available
            result = await sim.allocate(RESOURCE.name, 1)
            assert duck.pre_starts == [list(result.device_ids)]

    run(scenario())


def test_loading_a_driver_detects_its_capabilities():
    from host.config.plugins import DriverRegistry
    from host.core.hookspecs import hookimpl

    duck = DuckWithGate()

    class Plugin:
        @hookimpl
        def device_plugin_host_drivers(self):
            return [duck]

    registry = DriverRegistry()
    registry.add_plugin(Plugin(), "duck")
    assert registry.drivers == {"duck": duck}
    assert caps._records[id(duck)] == Capabilities(pre_start=True, pre_start_gate=True)
