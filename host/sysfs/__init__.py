"""Reading the kernel's view of the machine: the host root (``hostfs``), PCI functions and
classes, character devices (``/dev`` nodes and their sysfs parents), RDMA's char devices."""
