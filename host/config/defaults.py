"""The drivers' built-in default resources: what a node serves without a config file.

A driver whose defaults are broken loses them with a logged reason; it never stops the host
from serving every other kind of device.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Dict, List, Mapping, Optional, Sequence

from host.config.settings import Config, HostSettings
from host.core.capabilities import config_checks, default_resources
from host.core.driver import Driver
from host.core.model import ResourceConfig
from host.core.resource_name import resource_name_error

log = logging.getLogger(__name__)


def default_config(drivers: Mapping[str, Driver]) -> Config:
    """Every driver's default resources, with default host settings.

    A driver whose defaults are broken (an exception, a bad name, a name another driver took,
    selectors it rejects itself) loses those resources with a logged reason; it must not stop
    the host from serving every other kind of device.
    """
    resources: List[ResourceConfig] = []
    owner: Dict[str, str] = {}
    for driver_name in sorted(drivers):
        driver = drivers[driver_name]
        try:
            offered: Sequence[ResourceConfig] = default_resources(driver)
        except Exception:
            log.exception("driver %r: default_resources() failed; it serves nothing", driver_name)
            continue
        for resource in offered:
            problem = _default_resource_problem(driver, resource, owner)
            if problem is not None:
                log.warning("driver %r: default resource skipped: %s", driver_name, problem)
                continue
            # Defaults register only once they have a device (a node without AMD GPUs does not
            # advertise amd.com/gpu = 0); the host enforces it rather than trusting each driver.
            resources.append(
                dataclasses.replace(resource, driver=driver_name, register_when_empty=False)
            )
            owner[resource.name] = driver_name
    return Config(path=None, host=HostSettings(), resources=tuple(resources), is_default=True)


def _default_resource_problem(
    driver: Driver, resource: object, owner: Mapping[str, str]
) -> Optional[str]:
    if not isinstance(resource, ResourceConfig):
        return f"not a ResourceConfig: {resource!r}"
    problem = resource_name_error(resource.name)
    if problem is not None:
        return f"{resource.name!r} is not a valid resource name: {problem}"
    if resource.name in owner:
        return f"{resource.name!r} is already served by driver {owner[resource.name]!r}"
    check_selectors, check_settings = config_checks(driver)
    try:
        check_selectors(resource.selectors)
        check_settings(resource.settings)
    except Exception as error:
        return f"{resource.name!r} fails the driver's own checks: {error}"
    return None
