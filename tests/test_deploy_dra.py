"""The dra overlay (deploy/kubernetes/overlays/dra): schemas of the DRA versions, RBAC that
covers exactly what the host calls, the kubelet's plugin directories, NODE_NAME and one
DeviceClass per DRA resource. Rendered with kubectl's kustomize, like tests/test_deploy.py."""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any, Dict, List

import kubernetes_validate
import pytest
import yaml

from host.config import parse_config
from host.config.plugins import load_drivers
from host.dra.kube import API_ACCESS
from host.dra.naming import driver_name

try:
    import tomllib
except ImportError:  # pragma: no cover - Python < 3.11
    import tomli as tomllib  # type: ignore[no-redef]

REPO = Path(__file__).resolve().parents[1]
OVERLAY = REPO / "deploy" / "kubernetes" / "overlays" / "dra"
# resource.k8s.io/v1 (DeviceClass, ResourceSlice) is served from 1.34 on.
OLDEST_DRA_KUBERNETES = "1.34"
NAMESPACE = "device-plugin-host"


@functools.cache
def _text() -> str:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl (with its built-in kustomize) is not installed")
    result = subprocess.run([kubectl, "kustomize", str(OVERLAY)], capture_output=True,
                            text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    return result.stdout


def objects() -> List[Dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(_text()) if doc]


def of_kind(kind: str) -> List[Dict[str, Any]]:
    return [o for o in objects() if o["kind"] == kind]


def one(kind: str) -> Dict[str, Any]:
    found = of_kind(kind)
    assert len(found) == 1, kind
    return found[0]


def config():
    configmap = one("ConfigMap")
    return parse_config(configmap["data"]["config.toml"], "overlays/dra/config.toml",
                        load_drivers().with_unavailable())


@pytest.mark.parametrize("version", [OLDEST_DRA_KUBERNETES, kubernetes_validate.latest_version()])
def test_every_object_matches_the_schema_of_each_dra_version(version):
    problems = []
    for obj in objects():
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as error:
            where = ".".join(str(p) for p in error.absolute_path)
            problems.append(f"{obj['kind']} {obj['metadata']['name']}: {where}: {error.message}")
    assert not problems, "\n".join(problems)


def test_the_cluster_role_grants_what_the_client_calls_and_the_claims_watch():
    role = one("ClusterRole")
    granted = {(verb, group, resource) for rule in role["rules"]
               for group in rule["apiGroups"] for resource in rule["resources"]
               for verb in rule["verbs"]}
    assert set(API_ACCESS) <= granted
    # resourceslices CRUD, resourceclaims get/list/watch, nodes get/list/watch (the Node is
    # waited for and followed by name), pods get (the containers' claim references of a
    # claim's pods); nothing else (no secrets, no pod lists, no writes to nodes or pods).
    allowed = {(v, "resource.k8s.io", "resourceslices") for v in
               ("get", "list", "watch", "create", "update", "patch", "delete")}
    allowed |= {(v, "resource.k8s.io", "resourceclaims") for v in ("get", "list", "watch")}
    allowed |= {(v, "", "nodes") for v in ("get", "list", "watch")}
    allowed |= {("get", "", "pods")}
    assert granted == allowed


def test_the_daemonset_runs_as_the_bound_service_account_with_its_token():
    pod = one("DaemonSet")["spec"]["template"]["spec"]
    account = one("ServiceAccount")
    assert account["metadata"]["namespace"] == NAMESPACE
    assert pod["serviceAccountName"] == account["metadata"]["name"]
    assert pod["automountServiceAccountToken"] is True
    binding = one("ClusterRoleBinding")
    assert binding["roleRef"]["name"] == one("ClusterRole")["metadata"]["name"]
    assert {"kind": "ServiceAccount", "name": account["metadata"]["name"],
            "namespace": NAMESPACE} in binding["subjects"]
    policy = one("ValidatingAdmissionPolicy")
    assert one("ValidatingAdmissionPolicyBinding")["spec"]["policyName"] == \
        policy["metadata"]["name"]
    user = f"system:serviceaccount:{NAMESPACE}:{account['metadata']['name']}"
    assert user in policy["spec"]["matchConditions"][0]["expression"]


def test_node_name_comes_from_the_downward_api():
    container = one("DaemonSet")["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    # The config leaves node_name to NODE_NAME: one ConfigMap serves every node.
    text = one("ConfigMap")["data"]["config.toml"]
    assert "node_name" not in tomllib.loads(text).get("host", {})


def test_the_kubelet_plugin_directories_and_cdi_are_mounted_where_the_config_points():
    pod = one("DaemonSet")["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in pod["containers"][0]["volumeMounts"]}
    host = config().host
    for path in (host.plugins_registry_dir, host.dra_plugins_dir, host.cdi_dir):
        mount = mounts[path]
        assert not mount.get("readOnly"), path  # we create sockets and specs there
        assert volumes[mount["name"]]["hostPath"]["path"] == path
    state = [p for p in mounts if host.dra_state_dir.startswith(p.rstrip("/") + "/")]
    assert state and "hostPath" in volumes[mounts[state[0]]["name"]], \
        "the claim checkpoint must survive pod restarts"


def _class_driver(device_class: Dict[str, Any]) -> str:
    expressions = [s["cel"]["expression"] for s in device_class["spec"]["selectors"]]
    assert len(expressions) == 1, device_class["metadata"]["name"]
    match = re.match(r'device\.driver == "([^"]+)" && ', expressions[0])
    assert match, expressions[0]
    return match.group(1)


def test_every_dra_resource_has_a_device_class_with_its_extended_resource_name():
    resources = [r for r in config().resources if r.api == "dra"]
    assert resources
    classes = {c["spec"]["extendedResourceName"]: c for c in of_kind("DeviceClass")}
    assert len(classes) == len(of_kind("DeviceClass"))  # one class per extended resource
    drivers = {driver_name(r.name, r.dra_driver_name, r.driver) for r in resources}
    for resource in resources:
        assert _class_driver(classes[resource.name]) in drivers
    # Every class selects devices of a driver the config serves, first by driver (so its
    # attribute terms are never evaluated on another driver's devices).
    assert {_class_driver(c) for c in classes.values()} == drivers


def test_one_driver_name_per_vendor_and_classes_select_by_type_and_profile():
    classes = {c["spec"]["extendedResourceName"]: c for c in of_kind("DeviceClass")}
    nvidia = driver_name("nvidia.com/gpu", None, "gpu")
    assert _class_driver(classes["nvidia.com/gpu"]) == nvidia
    assert _class_driver(classes["nvidia.com/mig-1g.10gb"]) == nvidia
    for name, device_class in classes.items():
        expression = device_class["spec"]["selectors"][0]["cel"]["expression"]
        attrs = f'device.attributes["{_class_driver(device_class)}"]'
        if "/mig-" in name or (name.startswith("amd.com/") and name != "amd.com/gpu"):
            profile = name.split("/", 1)[1].removeprefix("mig-")
            kind = "mig" if "/mig-" in name else "partition"
            # profile is tested for before it is read: a missing key would abort allocation.
            assert expression.endswith(f'{attrs}.type == "{kind}" && "profile" in {attrs} && '
                                       f'{attrs}.profile == "{profile}"'), expression
        else:
            assert expression.endswith(f'{attrs}.type == "gpu" && '
                                       f'!("partitioned" in {attrs})'), expression


def test_the_device_classes_are_accepted_by_the_real_api_server():
    """CEL is compiled by the API server on create: a typo or a type error is a 422."""
    from host.sim.apiserver import RealApiServer, kubebuilder_assets

    assets = kubebuilder_assets()
    if not assets:
        pytest.skip("needs KUBEBUILDER_ASSETS (the real kube-apiserver compiles the CEL)")
    with RealApiServer(assets) as api:
        for device_class in of_kind("DeviceClass"):
            status, body = api._request("POST", "/apis/resource.k8s.io/v1/deviceclasses",
                                        device_class)
            assert status == 201, body
            assert body["spec"]["extendedResourceName"] == \
                device_class["spec"]["extendedResourceName"]


def test_no_resource_is_served_through_both_apis():
    apis: Dict[str, set] = {}
    for resource in config().resources:
        apis.setdefault(resource.name, set()).add(resource.api)
    assert all(len(v) == 1 for v in apis.values())
