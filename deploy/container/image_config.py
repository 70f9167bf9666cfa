"""The OCI layout's bookkeeping for deploy/container/build, with no tool but Python.

    image_config.py --index LAYOUT VERSION   an image index of every VERSION-ARCH manifest,
                                             tagged VERSION in the layout
    image_config.py --digest LAYOUT TAG      the manifest digest TAG names
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any, Dict, List

INDEX = "application/vnd.oci.image.index.v1+json"
REF = "org.opencontainers.image.ref.name"


def _read(layout: Path) -> Dict[str, Any]:
    data: Dict[str, Any] = json.loads((layout / "index.json").read_text())
    return data


def _blob(layout: Path, digest: str) -> Dict[str, Any]:
    algorithm, _, hexa = digest.partition(":")
    data: Dict[str, Any] = json.loads((layout / "blobs" / algorithm / hexa).read_bytes())
    return data


def digest_of(layout: Path, tag: str) -> str:
    for entry in _read(layout)["manifests"]:
        if entry.get("annotations", {}).get(REF) == tag:
            return str(entry["digest"])
    raise SystemExit(f"image_config: no tag {tag} in {layout}")


def write_index(layout: Path, version: str) -> str:
    """An index of the VERSION-ARCH manifests (sorted, so the same images give the same
    digest), stored as a blob and tagged VERSION in index.json."""
    top = _read(layout)
    manifests: List[Dict[str, Any]] = []
    for entry in top["manifests"]:
        tag = entry.get("annotations", {}).get(REF, "")
        if not tag.startswith(version + "-") or entry["mediaType"] == INDEX:
            continue
        config = _blob(layout, _blob(layout, entry["digest"])["config"]["digest"])
        manifests.append({"mediaType": entry["mediaType"], "digest": entry["digest"],
                          "size": entry["size"],
                          "platform": {"architecture": config["architecture"],
                                       "os": config["os"]}})
    manifests.sort(key=lambda m: m["platform"]["architecture"])
    body = json.dumps({"schemaVersion": 2, "mediaType": INDEX, "manifests": manifests},
                      sort_keys=True, separators=(",", ":")).encode()
    digest = "sha256:" + hashlib.sha256(body).hexdigest()
    path = layout / "blobs" / "sha256" / digest.split(":")[1]
    path.write_bytes(body)
    top["manifests"] = [e for e in top["manifests"]
                        if e.get("annotations", {}).get(REF) != version]
    top["manifests"].append({"mediaType": INDEX, "digest": digest, "size": len(body),
                             "annotations": {REF: version}})
    (layout / "index.json").write_text(json.dumps(top, sort_keys=True, separators=(",", ":")))
    return digest


def main(argv: List[str]) -> int:
    if len(argv) == 3 and argv[0] == "--index":
        print(write_index(Path(argv[1]), argv[2]))
        return 0
    if len(argv) == 3 and argv[0] == "--digest":
        print(digest_of(Path(argv[1]), argv[2]))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
