"""A simulated kubelet for DRA drivers: plugin watcher, DRA manager, restarts."""

from host.sim.kubelet_dra.simulator import ClaimInfo, DraKubeletSimulator, PrepareError
from host.sim.kubelet_dra.watcher import PluginWatcher, RegisteredPlugin

__all__ = ["ClaimInfo", "DraKubeletSimulator", "PluginWatcher", "PrepareError",
           "RegisteredPlugin"]
