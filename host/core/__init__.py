"""The core every layer builds on: the Device records and the driver contract (``model``,
``driver``, ``capabilities``), the selector engine, the default allocation and sharing,
health bookkeeping, driver loading (``plugins``, ``hookspecs``), and the host's small
mechanisms (file writes that never follow a symlink, directory watches, the one owner of
background tasks). Nothing here imports the layers above it."""
