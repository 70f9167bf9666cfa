"""dph-widget: a device-plugin-host driver for the kernel's compute accelerators (accel class).

An example of a third-party driver package: installed with pip next to device-plugin-host and
loaded through the ``device_plugin_host.drivers`` entry point, with no change to the host.
"""

__version__ = "0.1.0"
