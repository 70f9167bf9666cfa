"""``device-plugin-host pods``: the DRA claims this host has prepared, from its checkpoint.

The checkpoint is what the host itself relies on to unprepare, so showing it (rather than
asking the API server) tells an operator exactly which claims, pods, devices and CDI ids the
node holds, even while the API server or the host process is down.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional

from host.dra.checkpoint import FILE_NAME, decode_claims


def claim_rows(state_dir: str, resource_filter: Optional[str] = None) -> List[Dict[str, Any]]:
    """One row per prepared device of each claim; raises OSError/ValueError on a bad file."""
    try:  # read only: the host's own load() moves a damaged file aside, a viewer must not
        with open(os.path.join(state_dir, FILE_NAME), encoding="utf-8") as stream:
            claims = decode_claims(stream.read())
    except FileNotFoundError:
        return []
    except (KeyError, TypeError) as error:
        raise ValueError(f"damaged checkpoint: {error}") from None
    rows = []
    for claim in sorted(claims.values(), key=lambda c: (c.namespace, c.name)):
        for device in claim.devices:
            if resource_filter and not _matches(device.resource, resource_filter):
                continue
            rows.append({
                "namespace": claim.namespace, "claim": claim.name, "claim_uid": claim.uid,
                "pod_uids": list(claim.pod_uids), "resource": device.resource,
                "device_id": device.device_id, "pool": device.pool_name,
                "device": device.device_name, "requests": list(device.request_names),
                "cdi_device_ids": list(device.cdi_device_ids),
                # a share of a device several claims use (host.dra.sharing): its id, and
                # how many of the device's shares it holds (a replica: 1, no id)
                "share_id": device.share_id or None, "shares": device.shares,
            })
    return rows


def _matches(resource: str, pattern: str) -> bool:
    import fnmatch

    return fnmatch.fnmatchcase(resource, pattern)


def format_claims(rows: List[Dict[str, Any]]) -> List[str]:
    headers = ("CLAIM", "RESOURCE", "DEVICE", "ID", "REQUESTS", "CDI")
    table = [(f"{r['namespace']}/{r['claim']}", r["resource"], r["device"], r["device_id"],
              ",".join(r["requests"]) or "*", ",".join(r["cdi_device_ids"])) for r in rows]
    widths = [max([len(h)] + [len(t[i]) for t in table]) for i, h in enumerate(headers[:-1])]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths)) + "  " + headers[-1]]
    lines += ["  ".join(c.ljust(w) for c, w in zip(t, widths)) + "  " + t[-1] for t in table]
    return lines
