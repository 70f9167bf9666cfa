"""Shared fixtures come from the test kit, the same ones third-party driver authors use."""

from host.process import configure_process
from host.testing.fixtures import run, short_dir

# The suite runs the host in-process, so it applies the program's grpc settings the way the
# entry points do (importing ``host`` no longer does).
configure_process()

__all__ = ["run", "short_dir"]
