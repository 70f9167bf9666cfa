"""Shared fixtures come from the test kit's pytest plugin (host/testing/pytest_plugin.py,
registered by the ``pytest11`` entry point in pyproject.toml), the same one third-party driver
authors get by installing the host: ``short_dir``, ``run``, ``fake_tree``, ``aio``, ``kubelet``.
The plugin also applies the program's grpc settings (host.process) before grpc is imported."""
