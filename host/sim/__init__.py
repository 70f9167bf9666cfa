"""The simulated node that ``device-plugin-host demo`` runs the real host against: a sample
host tree built from real files, directories and symlinks in the kernel's shapes, a kubelet
simulator that speaks the real device plugin protocol over unix sockets, the DRA kubelet and
an API-server stand-in. The program imports it only for ``demo``; the test kit
(device_plugin_host_testing, a distribution of its own) builds on it."""
