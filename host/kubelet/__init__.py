"""Talking to the kubelet: the device-plugin protocol (``protocol``), the per-resource
service and snapshot, registration on ``kubelet.sock`` and its liveness, the plugin watcher's
registration (``plugin_watcher``), socket names, and the PodResources client."""
