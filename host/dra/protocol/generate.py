"""Regenerate the committed DRA and plugin-registration modules from our .proto files.

Same approach as ``host.protocol.generate`` (committed output, version gates stripped so
grpcio >= 1.65 and protobuf >= 5.26 load them, package-relative imports), plus ``.pyi``
stubs so the DRA code is type-checked against the messages. Run:
``python -m host.dra.protocol.generate``; ``tests/dra/test_dra_node_protocol.py`` fails when
the committed files drift.
"""

from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path
from typing import Dict

from host.protocol.generate import _without_version_gates

HERE = Path(__file__).resolve().parent
PROTOS = ("dra_v1.proto", "dra_v1beta1.proto", "dra_health_v1alpha1.proto",
          "pluginregistration_v1.proto")


def generate() -> Dict[str, str]:
    """Compile the protos into a temp dir; return {file name: text} of the generated files."""
    from grpc_tools import protoc  # test-only dependency

    with tempfile.TemporaryDirectory() as out:
        for proto in PROTOS:
            code = protoc.main(
                ["protoc", f"-I{HERE}", f"--python_out={out}", f"--pyi_out={out}",
                 f"--grpc_python_out={out}", str(HERE / proto)]
            )
            if code != 0:
                raise RuntimeError(f"protoc failed on {proto} ({code})")
        files = {}
        for path in sorted(Path(out).glob("*.py*")):
            text = path.read_text(encoding="utf-8")
            text = re.sub(r"^import (\w+_pb2) as", r"from . import \1 as", text, flags=re.M)
            files[path.name] = _without_version_gates(text)
        return files


def main() -> int:
    for name, text in generate().items():
        (HERE / name).write_text(text, encoding="utf-8")
        print(f"wrote host/dra/protocol/{name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
