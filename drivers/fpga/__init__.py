"""FPGA driver: Intel DFL accelerator ports (PAC Arria 10, N3000, D5005, OFS cards) and
AMD/Xilinx XRT cards (Alveo), with an optional pre-start program per resource."""
