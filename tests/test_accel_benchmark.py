"""benchmarks/discovery_accel.py in a tiny run: every figure comes with a floor, and each
driver finds every device its tree has (the module raises otherwise)."""

from __future__ import annotations

from benchmarks import discovery_accel
from benchmarks.core import Context


def test_tiny_run_gives_each_figure_with_a_floor():
    figures = discovery_accel.run(Context(tiny=True))
    assert [f.key for f in figures] == list(discovery_accel.KEYS)
    for figure in figures:
        assert figure.value > 0 and figure.floor and figure.floor > 0, figure
        assert figure.unit == "ms"
