"""Test kit for the host and for third-party driver authors: fake host trees built from real
files, directories and symlinks in the kernel's shapes, and a kubelet simulator that speaks
the real device plugin protocol over unix sockets."""
