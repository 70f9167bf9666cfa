"""Regenerate the committed Python modules from our .proto files.

The generated modules are committed so that a plain ``pip install`` needs no grpcio-tools;
``tests/test_protocol.py`` fails when they drift from the .proto files. Run:
``python -m host.protocol.generate``. Imports are rewritten to package-relative form so the
modules load as ``host.protocol.*`` without touching sys.path.
"""

from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path
from typing import Dict

HERE = Path(__file__).resolve().parent
PROTOS = ("deviceplugin_v1beta1.proto", "podresources_v1.proto")


def generate() -> Dict[str, str]:
    """Compile the protos into a temp dir; return {file name: text} of the generated modules."""
    from grpc_tools import protoc  # test-only dependency

    with tempfile.TemporaryDirectory() as out:
        for proto in PROTOS:
            code = protoc.main(
                ["protoc", f"-I{HERE}", f"--python_out={out}", f"--grpc_python_out={out}",
                 str(HERE / proto)]
            )
            if code != 0:
                raise RuntimeError(f"protoc failed on {proto} ({code})")
        files = {}
        for path in sorted(Path(out).glob("*.py")):
            text = path.read_text(encoding="utf-8")
            text = re.sub(r"^import (\w+_pb2) as", r"from . import \1 as", text, flags=re.M)
            files[path.name] = text
        return files


def main() -> int:
    for name, text in generate().items():
        (HERE / name).write_text(text, encoding="utf-8")
        print(f"wrote host/protocol/{name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
