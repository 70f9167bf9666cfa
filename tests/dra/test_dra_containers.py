"""Which claim references each container of a pod has, in the kubelet's order, and the
devices of a driver each container receives over them (host.dra.containers)."""

from __future__ import annotations

from host.dra.containers import container_refs, covers, unions


def _pod(resource_claims, containers, status=None, init=()):
    def container(name, refs):
        return {"name": name, "resources": {"claims": [
            dict({"name": c}, **({"request": r} if r else {})) for c, r in refs]}}
    return {"spec": {"resourceClaims": resource_claims,
                     "initContainers": [container(n, r) for n, r in init],
                     "containers": [container(n, r) for n, r in containers]},
            "status": status or {}}


def test_references_follow_the_pods_claim_order_and_resolve_templates_and_extended():
    pod = _pod([{"name": "a", "resourceClaimTemplateName": "t"},
                {"name": "b", "resourceClaimName": "claim-b"}],
               [("main", [("b", ""), ("a", "gpu")])],
               {"resourceClaimStatuses": [{"name": "a", "resourceClaimName": "pod-a-xyz"}],
                "extendedResourceClaimStatus": {
                    "resourceClaimName": "pod-extended",
                    "requestMappings": [{"containerName": "main", "resourceName": "x/gpu",
                                         "requestName": "container-0-request-0"}]}},
               init=[("setup", [("b", "")])])
    assert container_refs(pod) == {
        "setup": [("claim-b", "")],
        "main": [("pod-a-xyz", "gpu"), ("claim-b", ""),
                 ("pod-extended", "container-0-request-0")]}


def test_a_template_claim_not_made_yet_is_unknown():
    pod = _pod([{"name": "a", "resourceClaimTemplateName": "t"}], [("main", [("a", "")])])
    assert container_refs(pod) is None


def test_a_subrequest_belongs_to_its_request_and_containers_that_disagree_are_named():
    assert covers("gpu", "gpu/large") and covers("", "nic") and not covers("gpu", "gpus")
    results = {"shared": [("p", "g0", "gpu")], "one": [("p", "g1", "gpu")],
               "two": [("p", "g2", "gpu/large"), ("q", "n0", "nic")]}
    agreed, disagree = unions("shared", [("p", "gpu")],
                              [[("shared", ""), ("one", "")], [("shared", "gpu")]], results)
    assert agreed == {} and disagree == [("p", "gpu")]
    agreed, disagree = unions("two", [("p", "gpu/large"), ("q", "nic")],
                              [[("one", ""), ("two", "gpu")], [("two", "")]], results)
    assert disagree == [("p", "gpu/large")] and agreed == {("q", "nic"): ["n0"]}
