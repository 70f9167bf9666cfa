"""What a driver object can do: one required protocol and small optional capabilities.

Every driver satisfies :class:`DeviceDriver` (``name``, ``subsystems``, ``discover``). Each
optional step of the host's contract is a protocol of its own, and a driver has that
capability exactly when it defines the method; nothing is compared with a base class, so a
duck-typed driver and a :class:`host.core.driver.Driver` subclass are judged alike:

* :class:`Allocator` (``allocate``): adjusts the host's merge of the devices' data;
* :class:`PreferredAllocator` (``preferred``): its own GetPreferredAllocation policy, with
  :class:`PreferredGate` (``preferred_useful``) saying where that policy has anything to go by;
* :class:`ContainerPreStarter` (``pre_start``): a step before each container start, with
  :class:`PreStartGate` (``needs_pre_start``) saying which resources advertise it;
* :class:`SelectorChecker` (``check_selectors``) and :class:`SettingsChecker`
  (``check_settings``): its own checks of a resource's config;
* :class:`DefaultsProvider` (``default_resources``): resources served without a config file.

:meth:`Capabilities.of` detects them once per driver object and keeps the record; the host's
services read the record, never the driver's class. The functions below answer the host's
questions (does this resource need PreStartContainer, is a preferred policy worth
advertising, how are a resource's selectors checked) from that record.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Callable, Dict, Mapping, Optional, Protocol, Sequence, Tuple, runtime_checkable

from host.core.driver import check_types
from host.core.hostfs import HostFS
from host.core.model import ContainerAllocation, Device, PreferredRequest, ResourceConfig


@runtime_checkable
class DeviceDriver(Protocol):
    """What every driver has: a unique ``name``, the udev ``subsystems`` whose events rescan
    it, and ``discover``. The loader refuses an object without a non-empty ``name`` or a
    callable ``discover``; a driver without ``subsystems`` is rescanned only by the safety
    rescan and ``health_interval_s``."""

    @property
    def name(self) -> str: ...

    @property
    def subsystems(self) -> Tuple[str, ...]: ...

    def discover(
        self, host: HostFS, resources: Sequence[ResourceConfig]
    ) -> Mapping[str, Sequence[Device]]: ...


@runtime_checkable
class Allocator(Protocol):
    """Adjusts the host's merge of the requested devices' own data for one container."""

    def allocate(
        self, resource: ResourceConfig, devices: Sequence[Device], merged: ContainerAllocation
    ) -> ContainerAllocation: ...


@runtime_checkable
class PreferredAllocator(Protocol):
    """Has its own GetPreferredAllocation policy: preferred ids, or None for the host's."""

    def preferred(
        self, resource: ResourceConfig, request: PreferredRequest
    ) -> Optional[Sequence[str]]: ...


@runtime_checkable
class PreferredGate(Protocol):
    """Says whether its ``preferred`` has anything to go by for a resource's devices. Without
    it, a driver's own policy always counts as useful."""

    def preferred_useful(self, resource: ResourceConfig, devices: Sequence[Device]) -> bool: ...


@runtime_checkable
class ContainerPreStarter(Protocol):
    """Prepares devices before each container start; raises to fail the start."""

    def pre_start(self, resource: ResourceConfig, devices: Sequence[Device]) -> None: ...


@runtime_checkable
class PreStartGate(Protocol):
    """Says which resources advertise ``pre_start_required``. Without it, every resource of a
    driver with ``pre_start`` does, and no resource of a driver without it."""

    def needs_pre_start(self, resource: ResourceConfig) -> bool: ...


@runtime_checkable
class SelectorChecker(Protocol):
    """Checks a resource's ``[resource.selectors]``; raises SelectorError naming the key.
    Without it, the keys and value types are checked against the driver's
    ``selector_types`` (no selector is accepted where it has none)."""

    def check_selectors(self, selectors: Mapping[str, object]) -> None: ...


@runtime_checkable
class SettingsChecker(Protocol):
    """Checks a resource's ``[resource.settings]``; raises SelectorError naming the key.
    Without it, the keys and value types are checked against the driver's
    ``setting_types`` (no setting is accepted where it has none)."""

    def check_settings(self, settings: Mapping[str, object]) -> None: ...


@runtime_checkable
class DefaultsProvider(Protocol):
    """Offers the resources served when the config has no ``[[resource]]``."""

    def default_resources(self) -> Sequence[ResourceConfig]: ...


#: Every optional capability, in the order the docs list them.
OPTIONAL_CAPABILITIES = (Allocator, PreferredAllocator, PreferredGate, ContainerPreStarter,
                         PreStartGate, SelectorChecker, SettingsChecker, DefaultsProvider)


@dataclass(frozen=True)
class Capabilities:
    """The optional capabilities of one driver object, detected once (:meth:`of`)."""

    allocate: bool = False
    preferred: bool = False
    preferred_gate: bool = False
    pre_start: bool = False
    pre_start_gate: bool = False
    check_selectors: bool = False
    check_settings: bool = False
    default_resources: bool = False

    @classmethod
    def detect(cls, driver: object) -> Capabilities:
        """The capabilities ``driver`` has now (the methods it defines, on its class or
        itself)."""
        return cls(
            allocate=isinstance(driver, Allocator),
            preferred=isinstance(driver, PreferredAllocator),
            preferred_gate=isinstance(driver, PreferredGate),
            pre_start=isinstance(driver, ContainerPreStarter),
            pre_start_gate=isinstance(driver, PreStartGate),
            check_selectors=isinstance(driver, SelectorChecker),
            check_settings=isinstance(driver, SettingsChecker),
            default_resources=isinstance(driver, DefaultsProvider),
        )

    @classmethod
    def of(cls, driver: object) -> Capabilities:
        """The record of ``driver``: detected when the driver is loaded (host/config/plugins.py) or
        first used, and kept for the life of the object; methods a driver gains or loses
        afterwards are not seen."""
        key = id(driver)
        with _lock:
            found = _records.get(key)
        if found is not None:
            return found
        record = cls.detect(driver)
        try:  # forget the record when the driver goes, before its id can be reused
            weakref.finalize(driver, _forget, key)
        except TypeError:  # not weakly referable: detected again on each use (cheap)
            return record
        with _lock:
            return _records.setdefault(key, record)


_records: Dict[int, Capabilities] = {}
_lock = threading.Lock()


def _forget(key: int) -> None:
    with _lock:
        _records.pop(key, None)


def needs_pre_start(driver: object, resource: ResourceConfig) -> bool:
    """Whether ``resource`` advertises ``pre_start_required``: the driver's own
    ``needs_pre_start`` where it has one, else whether it has ``pre_start``. Raises what
    ``needs_pre_start`` raises."""
    capabilities = Capabilities.of(driver)
    if capabilities.pre_start_gate:
        return bool(driver.needs_pre_start(resource))  # type: ignore[attr-defined]
    return capabilities.pre_start


def preferred_useful(driver: object, resource: ResourceConfig,
                     devices: Sequence[Device]) -> bool:
    """Whether the driver's own ``preferred`` can improve on the kubelet's pick for these
    devices: never without ``preferred``, its ``preferred_useful`` where it has one, else
    always. Raises what ``preferred_useful`` raises."""
    capabilities = Capabilities.of(driver)
    if not capabilities.preferred:
        return False
    if capabilities.preferred_gate:
        return bool(driver.preferred_useful(resource, devices))  # type: ignore[attr-defined]
    return True


Check = Callable[[Mapping[str, object]], None]


def config_checks(driver: object) -> Tuple[Check, Check]:
    """The selector check and the settings check of a driver's resources: its own
    ``check_selectors`` and ``check_settings``, or, for one it does not have, the key and type
    check of its ``selector_types`` or ``setting_types``."""
    capabilities = Capabilities.of(driver)
    name = getattr(driver, "name", "?")
    selectors: Check = (
        driver.check_selectors if capabilities.check_selectors  # type: ignore[attr-defined]
        else _type_check(getattr(driver, "selector_types", None) or {},
                         f"selector for driver {name!r}", True))
    settings: Check = (
        driver.check_settings if capabilities.check_settings  # type: ignore[attr-defined]
        else _type_check(getattr(driver, "setting_types", None) or {},
                         f"setting for driver {name!r}", False))
    return selectors, settings


def _type_check(types: Mapping[str, Tuple[type, ...]], what: str, lists_allowed: bool) -> Check:
    def check(table: Mapping[str, object]) -> None:
        check_types(table, types, what, lists_allowed)

    return check


def default_resources(driver: object) -> Sequence[ResourceConfig]:
    """The driver's ``default_resources()``, or none when it has no such method. Raises what
    the driver raises."""
    if not Capabilities.of(driver).default_resources:
        return ()
    return tuple(driver.default_resources())  # type: ignore[attr-defined]
