"""The outputs: every consumer of "resource R now has devices D".

Each output owns its state, its timers (in the host's ``Background``) and its close. The
conductor (host/app.py) hands it every resource it serves:

* ``sync(resource, devices)``: the resource's devices now (the same list object until they
  change, so an output can skip work cheaply); called on the event loop, must not block.
* ``synced(first)``: a batch of syncs is done (``first``: the one at start); an output that
  writes a file for many resources at once writes it here.
* ``changed(before, after)``: a reload changed the resource's config; ``sync`` follows.
* ``forget(resource)``: the resource left the config (``resource``: its last config).
* ``close(hand_over)``: the host stops; ``hand_over``: another host serves the node now, so
  files that host writes too stay.

The two API outputs (device plugin, DRA) decide whether a resource is served at all; the
others follow what they serve.
"""

from __future__ import annotations

from typing import Sequence

from host.core.model import Device, ResourceConfig


class Output:
    """The interface every output implements; each hook does nothing unless overridden."""

    def sync(self, resource: ResourceConfig, devices: Sequence[Device]) -> None:
        """The resource's devices now."""

    def synced(self, first: bool) -> None:
        """A batch of syncs is done."""

    def changed(self, before: ResourceConfig, after: ResourceConfig) -> None:
        """A reload changed the resource's config; ``sync`` with the new one follows."""

    async def forget(self, resource: ResourceConfig) -> None:
        """The resource left the config."""

    async def close(self, hand_over: bool) -> None:
        """The host stops; nothing of this output runs or writes after this returns."""
