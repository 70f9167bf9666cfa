"""Start-up checks for DRA resources: fail at once, with one line, instead of serving wrong.

A DaemonSet pod without NODE_NAME (or with one that is no valid Node name), without API access
(no service account token, RBAC missing) or on a node where a device plugin already
advertises the same extended resource would otherwise start and then never publish, never
prepare, or double-count devices. Each case is a ``DraStartError``; the CLI prints it and
exits 2, like a bad config file. A device plugin that stopped but whose capacity the kubelet
still lists is not one of them: the host waits for the kubelet to drop it (host/migration.py);
nor is one the Node's status still shows serving because the kubelet has not written it since
the plugin stopped: that is re-read for ``STILL_SERVING_WAIT_S`` before the start is refused.

A Node that does not exist yet is not one of them: the kubelet registers it some time after it
starts (a node booting, joining the cluster, or registered again after ``kubectl delete
node``), so ``check_cluster`` reports it as missing and the host waits for it (host/dra/node.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Dict, Iterable, List, Optional

from host.config import Config
from host.core.model import ResourceConfig
from host.kubelet import socket_names
from host.kubelet.socket_names import MAX_SOCKET_PATH

log = logging.getLogger(__name__)

# How long a start waits for the Node's status to drop a device plugin's capacity for a name
# we serve through DRA: twice the kubelet's default nodeStatusUpdateFrequency (10 s).
STILL_SERVING_WAIT_S = 20.0


class DraStartError(Exception):
    """An operator-caused reason the DRA front end cannot start; ``str()`` is the line."""


def dra_resources(config: Config) -> Iterable[ResourceConfig]:
    return [r for r in config.resources if r.api == "dra"]


def check_settings(config: Config, instance: str = "") -> None:
    """What can be checked without the API server; ``instance``: the id the DRA sockets are
    named after (host.kubelet.socket_names.instance_id)."""
    from host.config.values import dns_subdomain_error
    from host.dra import naming

    if not config.host.node_name:
        raise DraStartError("api = \"dra\" needs this node's name: set [host] node_name or the "
                            "NODE_NAME environment variable (the downward API's spec.nodeName)")
    problem = dns_subdomain_error(config.host.node_name)
    if problem:
        raise DraStartError(f"node name {config.host.node_name!r} ([host] node_name / "
                            f"NODE_NAME) is not a valid Node name: {problem}")
    owners: Dict[str, str] = {}
    for resource in dra_resources(config):
        try:
            driver = naming.driver_name(resource.name, resource.dra_driver_name, resource.driver)
            naming.pool_name(resource.name, config.host.node_name)
        except ValueError as error:
            raise DraStartError(f"resource {resource.name}: {error}") from None
        socket = (f"{config.host.dra_plugins_dir}/{driver}/"
                  f"{socket_names.service_socket_file('dra', instance)}")
        if len(socket.encode()) > MAX_SOCKET_PATH:
            raise DraStartError(f"resource {resource.name}: the DRA socket {socket} is longer "
                                f"than a unix socket path can be ({MAX_SOCKET_PATH} bytes); "
                                f"shorten "
                                f"[host] dra_plugins_dir or dra_driver_name")
        owners.setdefault(driver, resource.name)


async def check_cluster(client: Any, config: Config) -> Optional[Dict[str, Any]]:
    """The API server lets us read our Node, and no device plugin on the node serves the same
    name as one of our DRA resources (one node must not serve a name through both APIs).

    Returns the Node, or None when it cannot be read now. Refusals (401, 403) are the
    operator's to fix: DraStartError. No such Node (404) is the kubelet not having registered
    it yet: None, and the host waits for it. An API server that does not answer (connection
    refused, timeout, 5xx, 429) is an outage, not a misconfiguration: None too; the host
    starts anyway, since the device plugin resources and claims already prepared must keep
    working, and the slice publisher retries until it returns.
    """
    node_name = config.host.node_name
    try:
        node = await client.get_node(node_name)
    except Exception as error:
        status = getattr(error, "status", None)
        reason = getattr(error, "reason", "") or str(error) or type(error).__name__
        if status == 404:
            return None
        if status in (401, 403):
            raise DraStartError(f"no API access for DRA (reading Node {node_name}): HTTP "
                                f"{status} {reason}: check the service account / kubeconfig "
                                "and the RBAC of the dra overlay") from None
        if status == 0 or status is None or status == 429 or status >= 500:
            log.warning("DRA: the API server does not answer (%s); starting anyway, slices "
                        "are published once it does", reason)
            return None
        raise DraStartError(f"no API access for DRA (reading Node {node_name}): HTTP "
                            f"{status} {reason}") from None
    conflict = capacity_conflict(node, config)
    if conflict:
        return await _wait_for_stop(client, config, conflict)
    return node


async def _wait_for_stop(client: Any, config: Config, conflict: str) -> Dict[str, Any]:
    """The Node shows a device plugin serving one of our DRA names: the kubelet writes the
    Node's status every ``nodeStatusUpdateFrequency`` (10 s by default), so a plugin that has
    just stopped (a host replaced by one with ``api = "dra"``) still shows there for up to
    that long. Re-read the Node once a second for ``STILL_SERVING_WAIT_S``; a conflict that
    outlasts it is a plugin that still serves: DraStartError."""
    log.warning("DRA: %s; waiting up to %.0f s for the kubelet's node status to show whether "
                "it has stopped", conflict, STILL_SERVING_WAIT_S)
    deadline = time.monotonic() + STILL_SERVING_WAIT_S
    while time.monotonic() < deadline:
        await asyncio.sleep(min(1.0, max(deadline - time.monotonic(), 0.0)))
        try:
            node = await client.get_node(config.host.node_name)
        except Exception:  # an outage or a Node gone while waiting: read again
            continue
        still = capacity_conflict(node, config)
        if still is None:
            return node
        conflict = still
    raise DraStartError(conflict)


def capacity_conflict(node: Dict[str, Any], config: Config) -> Optional[str]:
    """Why ``node`` shows a running device plugin serving one of our DRA resources (a
    non-zero allocatable: the kubelet zeroes it once the plugin's stream ends), or None."""
    allocatable = (node.get("status") or {}).get("allocatable") or {}
    for resource in dra_resources(config):
        amount = str(allocatable.get(resource.name, "0")).strip()
        if amount not in ("0", ""):
            return (f"resource {resource.name}: Node {config.host.node_name} has allocatable "
                    f"{resource.name}={amount} from a running device plugin; one node must "
                    "not serve a name through both APIs (stop that device plugin, or move the "
                    "name with a live reload of the config: docs/migration.md)")
    return None


def held_by_stopped_plugin(node: Optional[Dict[str, Any]], config: Config) -> List[str]:
    """Our DRA resources whose name the Node still lists with capacity from a device plugin
    that no longer serves it (allocatable 0): the kubelet keeps it for 5 minutes after the
    plugin's stream ended. Their pools wait until it is gone (host/migration.py)."""

    return [r.name for r in dra_resources(config) if advertised(node, r.name)]


def _nonzero(quantity: Any) -> bool:
    text = str(quantity if quantity is not None else "").strip()
    return text not in ("", "0")


def advertised(node: Optional[Dict[str, Any]], name: str) -> bool:
    """Whether the Node's status lists ``name`` with a non-zero capacity or allocatable."""
    if node is None:
        return False
    status = node.get("status") or {}
    return (_nonzero((status.get("capacity") or {}).get(name))
            or _nonzero((status.get("allocatable") or {}).get(name)))
