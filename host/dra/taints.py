"""Device taints for unhealthy DRA devices, and whether a claim's tolerations cover them.

With ``dra_unhealthy = "taint"`` an unhealthy device stays in its slice with one taint, key
``device-plugin-host.io/unhealthy``, value its health reason as a label value, and an effect
that says how bad it is (docs/dra.md lists the reasons):

* ``NoExecute``: the device failed hard or is gone (no kernel driver or the wrong one, the
  PCI function disabled, excluded by its driver, a device node missing, gone from the host).
  The eviction controller evicts pods that use it unless they tolerate the taint.
* ``NoSchedule``: drained by an operator, or a soft failure the device may recover from
  (ECC or AER errors, a failed health check): no new allocation, running pods stay.

A claim allocated with tolerations that cover the taint (a diagnostic pod) is a legitimate
request: NodePrepareResources prepares it and logs the taint at warning. Only a device that
cannot work at all is refused, tolerated or not: one gone from the host, or whose device
node is missing (the runtime could not create the container).

Tolerations come from the allocation result (``results[].tolerations``, copied from the
request by the scheduler) or, where a server without DRADeviceTaints dropped that field,
from the claim's request; they match as upstream's ``resourceclaim.ToleratesTaint`` does.
"""

from __future__ import annotations

import re
from typing import Any, Dict, List, Mapping, Optional

from host.core.model import Device

TAINT_KEY = "device-plugin-host.io/unhealthy"
NO_EXECUTE = "NoExecute"
NO_SCHEDULE = "NoSchedule"
DNS_LABEL_MAX = 63
_LABEL_VALUE_BAD = re.compile(r"[^A-Za-z0-9_.-]+")
_HARD = re.compile(r"^(gone from the host|device node .* missing|no kernel driver bound"
                   r"|bound to .*, not |PCI function disabled|excluded by )")
_UNUSABLE = re.compile(r"^(gone from the host|device node .* missing)")


def _parts(reason: str) -> List[str]:
    return [part.strip() for part in reason.split(";") if part.strip()]


def effect(reason: str) -> str:
    """NoExecute when any part of the health reason is a hard failure, else NoSchedule."""
    return NO_EXECUTE if any(_HARD.match(part) for part in _parts(reason)) else NO_SCHEDULE


def unusable(reason: str) -> Optional[str]:
    """The part of the reason that says the device cannot work at all, or None."""
    return next((part for part in _parts(reason) if _UNUSABLE.match(part)), None)


def taint_value(reason: str) -> str:
    """A health reason as a label value (<= 63, alphanumerics and -_. inside)."""
    value = _LABEL_VALUE_BAD.sub("-", reason).strip("-_.")[:DNS_LABEL_MAX]
    return value.rstrip("-_.") or "unhealthy"


def device_taint(device: Device) -> Dict[str, str]:
    """The taint an unhealthy device is published with."""
    return {"key": TAINT_KEY, "value": taint_value(device.health_reason),
            "effect": effect(device.health_reason)}


def tolerates(toleration: Mapping[str, Any], taint: Mapping[str, Any]) -> bool:
    """resourceclaim.ToleratesTaint: effect and key must match where given; operator Equal
    (the default) also compares the value, Exists does not."""
    if toleration.get("effect") and toleration.get("effect") != taint.get("effect"):
        return False
    if toleration.get("key") and toleration.get("key") != taint.get("key"):
        return False
    operator = toleration.get("operator") or "Equal"
    if operator == "Equal":
        return (toleration.get("value") or "") == (taint.get("value") or "")
    return operator == "Exists"


def tolerations_of(result: Mapping[str, Any], claim: Mapping[str, Any]) -> List[Mapping[str, Any]]:
    """The tolerations a device was allocated with: the result's own, else its request's
    (``exactly``, or the ``firstAvailable`` subrequest the result names)."""
    own = result.get("tolerations")
    if isinstance(own, list):
        return [t for t in own if isinstance(t, dict)]
    request, _, sub = str(result.get("request", "")).partition("/")
    requests = ((claim.get("spec") or {}).get("devices") or {}).get("requests") or ()
    for entry in requests:
        if not isinstance(entry, dict) or entry.get("name") != request:
            continue
        chosen: Any = entry.get("exactly") or {}
        for alternative in entry.get("firstAvailable") or ():
            if isinstance(alternative, dict) and alternative.get("name") == sub:
                chosen = alternative
        found = chosen.get("tolerations") if isinstance(chosen, dict) else None
        return [t for t in found or () if isinstance(t, dict)]
    return []
