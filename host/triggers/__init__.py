"""The triggers: every source of "rescan driver X" (or "look at this again").

Each trigger owns its watch or timer (timers live in the host's ``Background``, so a stop
cancels them all before any file is removed) and calls back into the conductor; none keeps
devices. Device events (udev, rtnetlink) coalesced per driver (``events``); the safety
rescan, the per-driver health checks and the expiry of vanished devices (``timers``); the
operators' drain file (``drains``). The CDI directory's watch belongs to the CDI stage
(host/outputs/cdi.py), the config file's to the reloader (host/cli/reload.py).
"""
