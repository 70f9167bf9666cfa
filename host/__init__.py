"""device-plugin-host: one process serving every kind of node device to the kubelet."""

import os as _os

__version__ = "0.1.0"

# grpc core logs every GOAWAY at INFO: hundreds of lines per kubelet restart. Errors only,
# unless the operator asks for more (it must be set before grpc is first imported).
_os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
# The host forks only to exec (a driver's pre-start program); grpc's fork handlers are for
# children that keep using grpc, and some grpcio releases crash such a child in them.
_os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
