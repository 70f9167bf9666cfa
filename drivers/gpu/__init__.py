"""GPU driver: NVIDIA, AMD and Intel GPUs found as PCI functions, served with their device nodes.

A GPU is only usable in a container together with its vendor's device nodes (/dev/nvidiaN and
the NVIDIA control nodes, /dev/kfd and the DRM nodes), so discovery maps each PCI function to
those nodes and reports the GPU Unhealthy when one is missing rather than handing out half.
"""
