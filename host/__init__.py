"""device-plugin-host: one process serving every kind of node device to the kubelet."""

__version__ = "0.1.0"
