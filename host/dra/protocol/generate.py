"""Regenerate the committed DRA modules from our .proto files.

Same approach as ``host.kubelet.protocol.generate`` (committed output, version gates stripped so
grpcio >= 1.65 and protobuf >= 5.26 load them, package-relative imports), plus ``.pyi``
stubs so the DRA code is type-checked against the messages. Run:
``python -m host.dra.protocol.generate``; ``tests/dra/test_dra_node_protocol.py`` fails when
the committed files drift.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Dict

from host.kubelet.protocol.generate import compile_protos, write

HERE = Path(__file__).resolve().parent
PROTOS = ("dra_v1.proto", "dra_v1beta1.proto", "dra_health_v1alpha1.proto",
          "dra_health_v1.proto")


def generate() -> Dict[str, str]:
    """Compile the protos into a temp dir; return {file name: text} of the generated files."""
    return compile_protos(HERE, PROTOS)


def main() -> int:
    write(HERE, generate())
    return 0


if __name__ == "__main__":
    sys.exit(main())
