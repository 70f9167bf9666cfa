"""accel driver: compute accelerators of the kernel's accel class (kernel 6.2+), served with
their /dev/accel nodes: Intel Gaudi (habanalabs), Intel NPU (intel_vpu), AMD XDNA (amdxdna),
Qualcomm Cloud AI 100 (qaic) and any other driver of drivers/accel."""
