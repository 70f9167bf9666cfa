"""The widget driver's tests need no fixtures of their own: installing device-plugin-host
gives pytest its test kit plugin (``short_dir``, ``run``, ``fake_tree``, ``aio``, ``kubelet``)."""
