"""Exit codes and the error every command raises for an operator's mistake.

Shared by the command modules (host/cli/__init__.py, host/cli/serve.py, host/cli/discovery.py) so
each failure is one line and a documented exit status, never a traceback.
"""

from __future__ import annotations

#: A bad config file, flag or argument; also a second host on the same plugin directory.
EXIT_CONFIG = 2


class CommandError(Exception):
    """An operator-caused failure of a command: ``str()`` is the line to print."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code
