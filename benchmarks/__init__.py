"""Benchmarks of the host against floors measured in the same run: ``python -m benchmarks``.

Absolute times differ tenfold between a laptop and a loaded CI runner; the ratio of a figure to
a floor taken on the same machine, minutes apart, with the same client, does not. So every
figure that has a meaningful floor is printed next to it, and targets are stated as ratios
wherever a floor exists (see benchmarks/README.md, written by ``--write-report``).
"""
