"""What a reloaded config changes, computed without touching anything.

``plan`` compares the running config with a new, already validated one: resources removed,
added, changed in place, moving between the device plugin API and DRA, renamed DRA drivers,
and the ``[host]`` settings that take effect only at a restart. The conductor
(host/app.py ``HostApp.reload``) applies it.
"""

from __future__ import annotations

import dataclasses
from typing import List, Tuple

from host.config import Config
from host.config.settings import restart_only
from host.core.model import ResourceConfig


@dataclasses.dataclass(frozen=True)
class ConfigChange:
    #: Resources that left the config, with their last config.
    removed: Tuple[ResourceConfig, ...] = ()
    #: Resources new to the config.
    added: Tuple[ResourceConfig, ...] = ()
    #: (before, after) of resources whose config changed and that stay on their API.
    changed: Tuple[Tuple[ResourceConfig, ResourceConfig], ...] = ()
    #: Resources whose ``api`` changed (their new config): never served by both at once.
    moved: Tuple[ResourceConfig, ...] = ()
    #: ``[host]`` settings that changed but take effect at the next restart.
    restart_only: Tuple[str, ...] = ()

    @property
    def drivers(self) -> List[str]:
        """The drivers to rescan before the new config is served."""
        return sorted({r.driver for r in self.added}
                      | {after.driver for _, after in self.changed}
                      | {r.driver for r in self.moved})


def plan(old: Config, new: Config) -> ConfigChange:
    before = {r.name: r for r in old.resources}
    after = {r.name: r for r in new.resources}
    changed = []
    moved = []
    added = []
    for name, resource in after.items():
        was = before.get(name)
        if was is None:
            added.append(resource)
        elif was != resource:
            if was.api != resource.api:
                moved.append(resource)
            else:
                changed.append((was, resource))
    return ConfigChange(
        removed=tuple(r for name, r in before.items() if name not in after),
        added=tuple(added), changed=tuple(changed), moved=tuple(moved),
        restart_only=tuple(restart_only(old.host, new.host)))
