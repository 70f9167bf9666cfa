"""Wire protocol: our .proto files, their generated modules, and conversion from the model.

``api`` is the device plugin v1beta1 module, ``api_grpc`` its services; ``podresources`` and
``podresources_grpc`` the kubelet's PodResources v1 API.
"""

from typing import Any

from host.kubelet.protocol import deviceplugin_v1beta1_pb2 as api
from host.kubelet.protocol import deviceplugin_v1beta1_pb2_grpc as api_grpc
from host.kubelet.socket_names import KUBELET_SOCKET, POD_RESOURCES_SOCKET

# The PodResources modules load on first use (``pods``, metrics' allocated_device, device-info
# cleanup): serving devices never needs them.
_LAZY = {"podresources": "podresources_v1_pb2", "podresources_grpc": "podresources_v1_pb2_grpc"}
# The kubelet's two health strings, from their one definition (host/core/model.py Health), read on
# first use: the wire modules stand alone, so a process that only speaks the protocol (the
# start-up floor in benchmarks/floors.py) does not build the model's dataclasses.
_HEALTH = {"HEALTHY", "UNHEALTHY"}


def __getattr__(name: str) -> Any:
    if name in _HEALTH:
        from host.core.model import Health

        value = Health[name].value
        globals()[name] = value
        return value
    if name in _LAZY:
        import importlib

        module = importlib.import_module(f"{__name__}.{_LAZY[name]}")
        globals()[name] = module
        return module
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

VERSION = "v1beta1"
DEVICE_PLUGIN_PATH = "/var/lib/kubelet/device-plugins"

__all__ = [
    "DEVICE_PLUGIN_PATH",
    "HEALTHY",
    "KUBELET_SOCKET",
    "POD_RESOURCES_SOCKET",
    "UNHEALTHY",
    "VERSION",
    "api",
    "api_grpc",
    "podresources",
    "podresources_grpc",
]
