"""Shared fixtures come from the test kit's pytest plugin (host/testing/pytest_plugin.py,
registered by the ``pytest11`` entry point in pyproject.toml), the same one third-party driver
authors get by installing the host: ``short_dir``, ``run``, ``fake_tree``, ``aio``, ``kubelet``."""

from host.process import configure_process

# The suite runs the host in-process, so it applies the program's grpc settings the way the
# entry points do (importing ``host`` no longer does).
configure_process()
