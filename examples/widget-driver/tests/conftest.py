"""The widget driver's tests use the host's test kit fixtures: short socket dirs, a runner."""

from device_plugin_host.testing import run, short_dir

__all__ = ["run", "short_dir"]
