"""Which of a driver's devices each container of a pod receives, across all of its claims.

The kubelet hands a container, for each of the pod's claims in ``pod.spec.resourceClaims``
order that the container references, the CDI ids of the claim's devices whose request names
include the referenced request (all of them for a whole-claim reference), and the claim of
extended resources (``pod.status.extendedResourceClaimStatus``) by its request mappings
(kubelet cm/dra manager ``GetResources``). The runtime applies the edits of those ids in order,
a later value of a variable replacing an earlier one (CDI ``ContainerEdits.Apply``). So a
variable that lists devices is right in a container only if every entry of the container that
sets it lists all the devices the container receives: ``unions`` says, per (pool, request)
entry of one claim, which devices that is, when all containers referencing the entry agree.

A pod claim made from a template is named by ``pod.status.resourceClaimStatuses``; a reference
that cannot be resolved makes the answer unknown (None), as does a claim of the container that
cannot be read.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

Ref = Tuple[str, str]  # (ResourceClaim name, referenced request; "" for the whole claim)
Entry = Tuple[str, str]  # (pool, the allocation result's request) of one claim


def container_refs(pod: Mapping[str, Any]) -> Optional[Dict[str, List[Ref]]]:
    """Each container's (init containers' too) claim references by ResourceClaim name, in
    the kubelet's order; None when a referenced pod claim has no ResourceClaim name yet."""
    spec = pod.get("spec") or {}
    status = pod.get("status") or {}
    generated = {str(s.get("name")): s.get("resourceClaimName")
                 for s in status.get("resourceClaimStatuses") or () if isinstance(s, dict)}
    order: List[Tuple[str, Optional[str]]] = []
    for entry in spec.get("resourceClaims") or ():
        name = str(entry.get("name"))
        order.append((name, entry.get("resourceClaimName") or generated.get(name)))
    extended = status.get("extendedResourceClaimStatus") or {}
    out: Dict[str, List[Ref]] = {}
    for container in [*(spec.get("initContainers") or ()), *(spec.get("containers") or ())]:
        wanted = ((container.get("resources") or {}).get("claims")) or ()
        refs: List[Ref] = []
        for pod_claim, claim_name in order:
            for ref in wanted:
                if ref.get("name") != pod_claim:
                    continue
                if not claim_name:
                    return None
                refs.append((str(claim_name), str(ref.get("request") or "")))
        for mapping in extended.get("requestMappings") or ():
            if mapping.get("containerName") == container.get("name"):
                if not extended.get("resourceClaimName"):
                    return None
                refs.append((str(extended["resourceClaimName"]),
                             str(mapping.get("requestName") or "")))
        out[str(container.get("name"))] = refs
    return out


def covers(ref_request: str, result_request: str) -> bool:
    """Whether a reference to ``ref_request`` ("" the whole claim) receives a device of
    ``result_request`` (a subrequest "gpu/large" belongs to "gpu")."""
    return not ref_request or result_request.split("/", 1)[0] == ref_request


def unions(claim_name: str, entries: Sequence[Entry],
           containers: Sequence[Sequence[Ref]],
           results_of: Mapping[str, Sequence[Tuple[str, str, str]]],
           ) -> Tuple[Dict[Entry, List[str]], List[Entry]]:
    """For the (pool, request) ``entries`` of claim ``claim_name``: the device names (in the
    pool) every container referencing an entry receives from that pool, over all its claims,
    in injection order; and the entries whose containers disagree. ``containers`` are the
    references of every container of the claim's pods; ``results_of`` maps each referenced
    claim name to its (pool, device, request) allocation results of our driver."""
    agreed: Dict[Entry, List[str]] = {}
    disagree: List[Entry] = []
    for pool, request in entries:
        seen: List[List[str]] = []
        for refs in containers:
            if not any(name == claim_name and covers(ref, request) for name, ref in refs):
                continue
            devices: List[str] = []
            for name, ref in refs:
                for result_pool, device, result_request in results_of.get(name, ()):
                    if result_pool == pool and covers(ref, result_request) \
                            and device not in devices:
                        devices.append(device)
            if devices not in seen:
                seen.append(devices)
        if len(seen) == 1:
            agreed[(pool, request)] = seen[0]
        elif len(seen) > 1:
            disagree.append((pool, request))
    return agreed, disagree
