"""The kubelet's DRA plugin API (v1, v1beta1) and its health stream.

``dra_v1`` / ``dra_v1beta1`` carry the same messages under two proto packages; the kubelet
picks one by the ``supported_versions`` we register with, so both services are served.
"""

from host.dra.protocol import dra_health_v1_pb2 as dra_health_v1
from host.dra.protocol import dra_health_v1alpha1_pb2 as dra_health
from host.dra.protocol import dra_health_v1alpha1_pb2_grpc as dra_health_grpc
from host.dra.protocol import dra_v1_pb2 as dra_v1
from host.dra.protocol import dra_v1_pb2_grpc as dra_v1_grpc
from host.dra.protocol import dra_v1beta1_pb2 as dra_v1beta1
from host.dra.protocol import dra_v1beta1_pb2_grpc as dra_v1beta1_grpc

#: The names the kubelet's DRA manager knows ("<proto package's last part>.<service>"), in
#: the order we offer them: the kubelet takes the first it supports, in our order.
DRA_SERVICES = ("v1.DRAPlugin", "v1beta1.DRAPlugin")
#: Full gRPC service names on the wire, by the short names above.
DRA_WIRE_SERVICES = {
    "v1.DRAPlugin": "k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin",
    "v1beta1.DRAPlugin": "k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin",
}
#: The health stream's full service names on the wire, also listed among the supported
#: versions: the 1.36 kubelet calls v1alpha1 on every DRA plugin when ResourceHealthStatus is
#: on; newer ones call the one a plugin lists, v1 where it lists both (pickHealthService).
DRA_HEALTH_SERVICE = "v1alpha1.DRAResourceHealth"
DRA_HEALTH_SERVICE_V1 = "v1.DRAResourceHealth"
DRA_HEALTH_SERVICES = (DRA_HEALTH_SERVICE_V1, DRA_HEALTH_SERVICE)

__all__ = [
    "DRA_HEALTH_SERVICE",
    "DRA_HEALTH_SERVICES",
    "DRA_HEALTH_SERVICE_V1",
    "DRA_SERVICES",
    "DRA_WIRE_SERVICES",
    "dra_health",
    "dra_health_grpc",
    "dra_health_v1",
    "dra_v1",
    "dra_v1_grpc",
    "dra_v1beta1",
    "dra_v1beta1_grpc",
]
