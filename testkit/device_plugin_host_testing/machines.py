"""Captured machines (``machines/*.tree``, written by ``device-plugin-host capture``): whole
host trees of real servers, materialised under a temporary root for tests."""

from __future__ import annotations

from pathlib import Path
from typing import List

from host.sim.tree import FakeTree, PathLike

MACHINES = Path(__file__).with_name("machines")


def load_machine(name_or_path: PathLike, root: PathLike) -> FakeTree:
    """Materialise a captured machine (a name from ``machine_names()``, or a file path)."""
    path = Path(name_or_path)
    if not path.exists():
        path = MACHINES / f"{name_or_path}.tree"
    tree = FakeTree(root)
    tree.load(path.read_text(encoding="utf-8"))
    return tree


def machine_names() -> List[str]:
    return sorted(p.stem for p in MACHINES.glob("*.tree"))
