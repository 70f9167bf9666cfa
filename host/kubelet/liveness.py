"""What ``/healthz`` on the metrics server answers, for a liveness probe (the DaemonSet's).

Two failures are worth a restart, and neither ends the process by itself:

* The event loop is stuck (a blocking call, a livelock): ``/healthz`` is answered by the
  loop itself, so a stuck loop answers nothing and the probe's own timeout fails it. No
  thread answers on the loop's behalf, which would report a dead host as alive.
* A resource could not register for ``grace_s`` while the kubelet is up (its kubelet.sock
  is a live socket in the plugin directory): the kubelet then advertises none of its
  devices, and a fresh process (new sockets, new gRPC servers, a new registration) is the
  remedy the host cannot apply to itself. While the kubelet is away, nothing can register
  and restarting would not help, so the clock only runs while kubelet.sock is there.
* The same for a DRA driver of ours that the kubelet's plugin watcher has not registered
  (GetInfo and NotifyRegistrationStatus with registered = true): the kubelet prepares no
  claim of that driver. The kubelet's device-plugin socket tells that the kubelet is up here
  too (the kubelet makes it at every start, whatever API a node's resources use), and the
  same grace applies.

The clock of a resource or driver starts at the first check that sees it unregistered with
the kubelet up, so the probe's period is its resolution; the default grace (300 s) is the
kubelet's own for a plugin that stopped (``endpointStopGracePeriod``).
"""

from __future__ import annotations

import os
import stat
import time
from typing import Callable, Dict, List, Mapping, Optional, Tuple

from host.kubelet.socket_names import KUBELET_SOCKET


def kubelet_is_up(plugin_dir: str) -> bool:
    """kubelet.sock exists as a socket (a stale regular file or nothing means no kubelet)."""
    try:
        return stat.S_ISSOCK(os.stat(os.path.join(plugin_dir, KUBELET_SOCKET)).st_mode)
    except OSError:
        return False


class RegistrationLiveness:
    """``problems()`` lists the resources (``registered``: device plugins, by resource name)
    and DRA drivers (``dra_registered``: by driver name) unregistered for longer than the
    grace while the kubelet is up; empty means alive. Everything is read through callables so
    a reload that changes the resources or the grace is seen at the next check."""

    def __init__(
        self,
        registered: Callable[[], Mapping[str, bool]],
        plugin_dir: Callable[[], str],
        grace_s: Callable[[], float],
        clock: Callable[[], float] = time.monotonic,
        dra_registered: Optional[Callable[[], Mapping[str, bool]]] = None,
    ) -> None:
        self._registered = registered
        self._dra_registered = dra_registered
        self._plugin_dir = plugin_dir
        self._grace_s = grace_s
        self._clock = clock
        # (kind, name) -> when first seen unregistered; kind "resource" or "DRA driver".
        self._since: Dict[Tuple[str, str], float] = {}

    def problems(self) -> List[str]:
        grace = self._grace_s()
        state = {("resource", name): ok for name, ok in self._registered().items()}
        if self._dra_registered is not None:
            state.update({("DRA driver", name): ok
                          for name, ok in self._dra_registered().items()})
        directory = self._plugin_dir()
        up = kubelet_is_up(directory)
        now = self._clock()
        for key in list(self._since):
            if not up or state.get(key, True):
                del self._since[key]
        if grace <= 0 or not up:
            return []
        problems = []
        kubelet = os.path.join(directory, KUBELET_SOCKET)
        for key, registered in sorted(state.items()):
            if registered:
                continue
            waited = now - self._since.setdefault(key, now)
            if waited < grace:
                continue
            kind, name = key
            if kind == "resource":
                problems.append(f"resource {name} has not registered for {waited:.0f} s while "
                                f"the kubelet is up ({kubelet})")
            else:
                problems.append(f"DRA driver {name} has not been registered by the kubelet's "
                                f"plugin watcher for {waited:.0f} s while the kubelet is up "
                                f"({kubelet}): the kubelet prepares none of its claims, and "
                                "its pools are published only once it is")
        return problems
