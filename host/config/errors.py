"""Config errors and how they name keys and values: one line, ``file: key: reason``.

Every part of config checking (host settings, resources, the drivers' own checks) raises
ConfigError, and the CLI prints ``str(error)`` and exits 2. The helpers write keys and values
the way the operator wrote them in TOML, so the line points at the exact spot.
"""

from __future__ import annotations

import json
import re
from typing import Sequence

_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+\Z")


#: The key used for problems with the file as a whole (missing, unreadable, not UTF-8).
FILE_KEY = "(file)"


class ConfigError(Exception):
    """One problem in a config file; ``str()`` is the line the CLI prints."""

    def __init__(self, file: str, key: str, reason: str) -> None:
        super().__init__(f"{file}: {key}: {reason}")
        self.file = file
        self.key = key
        self.reason = reason


def toml_key(key: str) -> str:
    """A key as TOML would write it, so odd keys in messages are unambiguous."""
    return key if _BARE_KEY.match(key) else json.dumps(key)


def hint(word: str, choices: Sequence[str]) -> str:
    import difflib  # only for a misspelt value

    close = difflib.get_close_matches(word, list(choices), n=1)
    return f' (did you mean "{close[0]}"?)' if close else ""


def unknown_key(key: str, known: Sequence[str]) -> str:
    import difflib  # only for a misspelt value

    close = difflib.get_close_matches(key, list(known), n=1)
    if close:
        return f'unknown key (did you mean "{close[0]}"?)'
    return "unknown key; known keys: " + ", ".join(known)


def show(value: object) -> str:
    """A value the way the user wrote it in TOML, cut short so the error stays one line."""
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, str):
        text = json.dumps(value, ensure_ascii=False)
    elif isinstance(value, (int, float)):
        text = repr(value)
    else:
        text = str(value)
    return text if len(text) <= 80 else text[:77] + "..."


def typed(value: object) -> str:
    """A value with its TOML type, for messages where the type is the problem."""
    kinds = ((bool, "a boolean"), (str, "a string"), (int, "an integer"), (float, "a float"))
    for kind, words in kinds:
        if isinstance(value, kind):
            return f"{words} ({show(value)})"
    if isinstance(value, dict):
        return "a table"
    if isinstance(value, list):
        return "an array"
    return f"a {type(value).__name__} ({value})"
