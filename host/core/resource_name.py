"""The kubelet's exact extended-resource name rules (IsExtendedResourceName).

The kubelet rejects a Register whose name fails these, and the API server rejects pods that
request it, so config validation and the kubelet simulator share this one check.
"""

from __future__ import annotations

import re
from typing import Optional

_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*\Z")
_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]\Z")


def resource_name_error(name: str) -> Optional[str]:
    """Why ``name`` is not a valid extended resource name, or None when it is."""
    if not isinstance(name, str) or not name:
        return "must be a non-empty string"
    if "/" not in name:
        return "needs a domain prefix ('vendor.example/name'); names without '/' are native"
    if "kubernetes.io/" in name:
        return "must not contain 'kubernetes.io/' (reserved)"
    if name.startswith("requests."):
        return "must not start with 'requests.'"
    parts = ("requests." + name).split("/")
    if len(parts) != 2:
        return "must contain exactly one '/'"
    prefix, short = parts
    if prefix == "requests.":
        return "the domain before '/' is empty"
    if len(prefix) > 253:
        return f"the domain is {len(prefix) - 9} characters; at most 244 are allowed"
    if not _SUBDOMAIN.match(prefix):
        return "the domain must be a lowercase DNS subdomain ([a-z0-9], '-' and '.' inside)"
    if not short:
        return "the name after '/' is empty"
    if len(short) > 63:
        return f"the name after '/' is {len(short)} characters; at most 63 are allowed"
    if not _NAME.match(short):
        return (
            "the name after '/' must start and end with a letter or digit and contain only"
            " letters, digits, '-', '_' and '.'"
        )
    return None

