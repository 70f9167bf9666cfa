"""Shared fixtures come from the test kit, the same ones third-party driver authors use."""

from host.testing.fixtures import run, short_dir

__all__ = ["run", "short_dir"]
