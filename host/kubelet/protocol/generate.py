"""Regenerate the committed Python modules from our .proto files.

The generated modules are committed so that a plain ``pip install`` needs no grpcio-tools;
``tests/test_protocol.py`` fails when they drift from the .proto files. Run:
``python -m host.kubelet.protocol.generate``. Imports are rewritten to package-relative form so the
modules load as ``host.kubelet.protocol.*`` without touching sys.path. protoc's ``--pyi_out`` writes
a ``.pyi`` stub beside each ``_pb2`` module: the ``_pb2`` code builds its classes at run time,
so without the stubs mypy sees every message as ``Any`` and checks nothing we build or read
(the ``_pb2_grpc`` modules are plain Python that mypy reads as they are).
"""

from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path
from typing import Dict, Sequence

HERE = Path(__file__).resolve().parent
PROTOS = ("deviceplugin_v1beta1.proto", "podresources_v1.proto", "pluginregistration_v1.proto")


def generate() -> Dict[str, str]:
    """Compile the protos into a temp dir; return {file name: text} of the generated modules."""
    return compile_protos(HERE, PROTOS)


def compile_protos(here: Path, protos: Sequence[str]) -> Dict[str, str]:
    """protoc over ``protos`` in ``here`` (also used by host.dra.protocol.generate): the
    generated modules and stubs with package-relative imports and no version gates."""
    from grpc_tools import protoc  # test-only dependency

    with tempfile.TemporaryDirectory() as out:
        for proto in protos:
            code = protoc.main(
                ["protoc", f"-I{here}", f"--python_out={out}", f"--pyi_out={out}",
                 f"--grpc_python_out={out}", str(here / proto)]
            )
            if code != 0:
                raise RuntimeError(f"protoc failed on {proto} ({code})")
        files = {}
        for path in sorted(Path(out).glob("*.py*")):
            text = path.read_text(encoding="utf-8")
            text = re.sub(r"^import (\w+_pb2) as", r"from . import \1 as", text, flags=re.M)
            files[path.name] = _without_version_gates(text)
        return files


def write(here: Path, files: Dict[str, str]) -> None:
    for name, text in files.items():
        (here / name).write_text(text, encoding="utf-8")
        print(f"wrote {here / name}")


def _without_version_gates(text: str) -> str:
    """Drop the generator's "runtime must be at least the generator's version" checks.

    The generated code only uses APIs that protobuf 5.26+ and grpcio 1.65+ have, while the
    gates would demand the exact generator versions (7.35 / 1.85, which have no Python 3.9
    wheels); pyproject.toml states the real floors, and CI runs the suite on the oldest.
    """
    text = re.sub(
        r"from google\.protobuf import runtime_version as _runtime_version\n", "", text
    )
    text = re.sub(r"_runtime_version\.ValidateProtobufRuntimeVersion\(\n(?:.*\n)*?\)\n", "",
                  text)
    text = re.sub(
        r"\nGRPC_GENERATED_VERSION = .*?\n(?:.*\n)*?    \)\n",
        "\n",
        text,
    )
    return text


def main() -> int:
    write(HERE, generate())
    return 0


if __name__ == "__main__":
    sys.exit(main())
