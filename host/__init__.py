"""device-plugin-host: one process serving every kind of node device to the kubelet.

Importing this package (or any module a driver imports) changes no process state: the grpc
settings the daemon wants are applied by its entry points (``host.process``), not here, so a
driver package, a test or a tool embedding the host keeps its own environment.
"""

__version__ = "0.1.0"
