"""The Kubernetes manifests and the image recipe in deploy/.

Base and every overlay are rendered by kubectl's built-in kustomize, exactly as
``kubectl apply -k`` renders them and without a cluster or network, then every object is
checked against the Kubernetes OpenAPI schemas that kubernetes-validate ships (strict: a
misspelled field fails) and the rendered ConfigMap's TOML goes through the real
``python -m host check-config``. The remaining tests hold what neither a schema nor
check-config can see: the mounts must match the paths in the config, the rules the API server
adds on top of the schema, and the image recipe must agree with the DaemonSet.

kubectl is installed on this project's development and CI machines; where it is missing (a
laptop) the tests that render are skipped with that reason.
"""

from __future__ import annotations

import functools
import json
import posixpath
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

import kubernetes_validate
import pytest
import yaml
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from host.config import parse_config
from host.config.plugins import load_drivers
from host.core.model import ResourceConfig
from host.metrics import parse_address

try:
    import tomllib
except ImportError:  # pragma: no cover - Python < 3.11
    import tomli as tomllib  # type: ignore[no-redef]

REPO = Path(__file__).resolve().parents[1]
KUBE = REPO / "deploy" / "kubernetes"
CONTAINERFILE = REPO / "deploy" / "container" / "Containerfile"
CONSTRAINTS = REPO / "deploy" / "container" / "constraints.txt"
IGNOREFILE = REPO / "deploy" / "container" / "Containerfile.dockerignore"

# recursiveReadOnly (used on /sys and /dev) exists from Kubernetes 1.30 on.
OLDEST_KUBERNETES = "1.30"
NAME = "device-plugin-host"
CONFIG_KEY = "config.toml"
ENTRYPOINT = ["device-plugin-host"]
CMD = ["run", "--config", "/etc/device-plugin-host/config.toml"]
IMAGE_PYTHON = "3.12"

# The DRA overlay's RBAC, admission policy and DeviceClass are cluster-wide objects.
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "ValidatingAdmissionPolicy",
                  "ValidatingAdmissionPolicyBinding", "DeviceClass"}

KUSTOMIZATIONS = [
    "base",
    *sorted(f"overlays/{path.parent.name}" for path in KUBE.glob("overlays/*/kustomization.yaml")),
]


# -- rendering -------------------------------------------------------------------------------


@functools.cache
def _rendered_text(name: str) -> str:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl (with its built-in kustomize) is not installed")
    result = subprocess.run(
        [kubectl, "kustomize", str(KUBE / name)],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert result.returncode == 0, f"kubectl kustomize {name} failed:\n{result.stderr}"
    return result.stdout


def render(name: str) -> List[Dict[str, Any]]:
    """A fresh copy each time, so a test cannot change what the next one sees."""
    return [doc for doc in yaml.safe_load_all(_rendered_text(name)) if doc]


def only(objects: List[Dict[str, Any]], kind: str) -> Dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, got {[o['metadata']['name'] for o in found]}"
    return found[0]


def pod_spec(objects: List[Dict[str, Any]]) -> Dict[str, Any]:
    return only(objects, "DaemonSet")["spec"]["template"]["spec"]


def container(objects: List[Dict[str, Any]]) -> Dict[str, Any]:
    containers = pod_spec(objects)["containers"]
    assert [c["name"] for c in containers] == [NAME]
    return containers[0]


def mounts(objects: List[Dict[str, Any]]) -> Dict[str, Dict[str, Any]]:
    """mountPath -> the mount, with the volume it mounts under the key "volume"."""
    volumes = {v["name"]: v for v in pod_spec(objects)["volumes"]}
    result = {}
    for mount in container(objects)["volumeMounts"]:
        assert mount["name"] in volumes, f"mount {mount['mountPath']}: no volume {mount['name']}"
        assert mount["mountPath"] not in result, f"mounted twice: {mount['mountPath']}"
        result[mount["mountPath"]] = {**mount, "volume": volumes[mount["name"]]}
    return result


def config_text(objects: List[Dict[str, Any]]) -> str:
    return only(objects, "ConfigMap")["data"][CONFIG_KEY]


def containerfile_entrypoint(instruction: str = "ENTRYPOINT") -> List[str]:
    lines = [line for line in CONTAINERFILE.read_text().splitlines()
             if line.startswith(instruction + " ")]
    assert len(lines) == 1
    return json.loads(lines[0][len(instruction) + 1:])


def test_every_overlay_is_found():
    assert {"base", "overlays/gpu-nodes", "overlays/sriov-nodes",
            "overlays/fpga-nodes"} <= set(KUSTOMIZATIONS)


# -- schemas ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
@pytest.mark.parametrize("version", [OLDEST_KUBERNETES, kubernetes_validate.latest_version()])
def test_every_object_matches_the_kubernetes_schema(name, version):
    if name == "overlays/dra":
        pytest.skip("resource.k8s.io/v1 exists from 1.34: tests/test_deploy_dra.py validates it")
    objects = render(name)
    # The headless Service lists the pods for Prometheus.
    assert {o["kind"] for o in objects} == {"Namespace", "ConfigMap", "DaemonSet", "Service"}
    problems = []
    for obj in objects:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as error:
            where = ".".join(str(part) for part in error.absolute_path)
            problems.append(f"{obj['kind']} {obj['metadata']['name']}: {where}: {error.message}")
    assert not problems, f"{name} (Kubernetes {version}):\n" + "\n".join(problems)


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_the_oldest_supported_kubernetes_is_the_oldest_the_manifests_fit(name):
    """The test above shows the manifests fit OLDEST_KUBERNETES; one release before must not
    (recursiveReadOnly is unknown to 1.29), or the README would promise too little; and the
    README must say the same version."""
    if name == "overlays/dra":
        pytest.skip("resource.k8s.io/v1 exists from 1.34: tests/test_deploy_dra.py validates it")
    major, minor = (int(part) for part in OLDEST_KUBERNETES.split("."))
    older = f"{major}.{minor - 1}"
    problems = []
    for obj in render(name):
        try:
            kubernetes_validate.validate(obj, older, strict=True)
        except kubernetes_validate.ValidationError as error:
            problems.append(error.message)
    assert any("recursiveReadOnly" in p for p in problems), (older, problems)
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("## Running in Kubernetes"):]
    section = section[: section.index("\n## ", 1)]
    assert f"**Kubernetes {OLDEST_KUBERNETES} or newer.**" in section


def test_the_schema_check_is_strict():
    """A misspelled field must fail, or the schema test above proves little."""
    daemonset = only(render("base"), "DaemonSet")
    daemonset["spec"]["template"]["spec"]["containers"][0]["volumeMount"] = []
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(daemonset, OLDEST_KUBERNETES, strict=True)


# -- the config ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_the_configmap_passes_check_config(name, tmp_path):
    path = tmp_path / CONFIG_KEY
    path.write_text(config_text(render(name)), encoding="utf-8")
    result = subprocess.run(
        [sys.executable, "-m", "host", "check-config", str(path)],
        cwd=REPO, capture_output=True, text=True, timeout=60, check=False,
    )
    assert result.returncode == 0, f"{name}: {result.stdout}{result.stderr}"
    assert "valid" in result.stdout


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_the_configmap_holds_the_kustomization_s_own_file(name):
    """An overlay's configMapGenerator replaces the base file instead of merging into it."""
    objects = render(name)
    own = KUBE / name / CONFIG_KEY
    assert config_text(objects) == own.read_text(encoding="utf-8")
    configmap = only(objects, "ConfigMap")
    assert list(configmap["data"]) == [CONFIG_KEY]


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_the_daemonset_mounts_the_generated_configmap_where_the_image_reads_it(name):
    objects = render(name)
    configmap = only(objects, "ConfigMap")
    # The hash suffix is what turns a config change into a rollout.
    assert re.fullmatch(rf"{NAME}-config-[a-z0-9]{{10}}", configmap["metadata"]["name"])
    config_path = containerfile_entrypoint("CMD")[-1]
    mount = mounts(objects)[posixpath.dirname(config_path)]
    assert mount["volume"]["configMap"]["name"] == configmap["metadata"]["name"]
    assert mount["readOnly"] is True
    assert "subPath" not in mount  # a subPath mount would never see a new file
    assert "items" not in mount["volume"]["configMap"]
    assert posixpath.basename(config_path) == CONFIG_KEY


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_the_paths_in_the_config_are_the_mounted_host_paths(name):
    """host_root "/" means the host reads /sys and /dev where it is and hands those same paths
    to the kubelet, so each must be the node's own directory mounted at the same path; the
    kubelet's directories must be mounted as directories (sockets are re-created)."""
    text = config_text(render(name))
    host = parse_config(text, f"{name}/{CONFIG_KEY}",
                        load_drivers().with_unavailable()).host
    assert host.host_root == "/"
    by_path = mounts(render(name))

    for path in ("/sys", "/dev"):
        mount = by_path[path]
        assert mount["volume"]["hostPath"] == {"path": path, "type": "Directory"}

    plugins = by_path[host.plugin_dir]
    assert plugins["volume"]["hostPath"]["type"] == "Directory"
    assert plugins["volume"]["hostPath"]["path"].endswith("/device-plugins")
    assert not plugins.get("readOnly", False)  # our sockets are created there

    pod_resources = by_path[posixpath.dirname(host.pod_resources_socket)]
    assert pod_resources["volume"]["hostPath"]["type"] in ("Directory", "DirectoryOrCreate")
    assert pod_resources["volume"]["hostPath"]["path"].endswith("/pod-resources")

    cdi = by_path["/var/run/cdi"]
    assert cdi["volume"]["hostPath"] == {"path": "/var/run/cdi", "type": "DirectoryOrCreate"}


def test_the_base_config_serves_the_built_in_defaults():
    """The base goes onto every Linux node of a mixed cluster; explicit resources would make
    every node register every one of them, with zero devices."""
    config = parse_config(config_text(render("base")), "base/config.toml",
                          load_drivers().with_unavailable())
    assert config.is_default
    assert "nvidia.com/gpu" in {r.name for r in config.resources}


# -- metrics and liveness --------------------------------------------------------------------
MONITORING = KUBE / "monitoring"


def _metrics_port(objects: List[Dict[str, Any]]) -> int:
    ports = {p["name"]: p for p in container(objects).get("ports", [])}
    assert "metrics" in ports, "the container has no port named metrics"
    assert ports["metrics"].get("protocol", "TCP") == "TCP"
    return ports["metrics"]["containerPort"]


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_metrics_listen_where_a_scraper_and_the_probe_reach_them(name):
    """Inside the pod 127.0.0.1 is reachable by nothing outside it: the kubelet's probe and
    Prometheus connect to the pod IP. Every kustomization's own config (an overlay replaces
    the base file) must listen on all of the pod's addresses, on the port named metrics."""
    objects = render(name)
    host = parse_config(config_text(objects), f"{name}/{CONFIG_KEY}",
                        load_drivers().with_unavailable()).host
    bound = parse_address(host.metrics_address)
    assert bound is not None, f"{name}: metrics are off, the liveness probe would fail"
    address, port = bound
    assert address in (None, "0.0.0.0", "::"), f"{name}: metrics bound to {address} only"
    assert port == _metrics_port(objects)
    probe = container(objects)["livenessProbe"]
    assert probe["httpGet"] == {"path": "/healthz", "port": "metrics"}
    # A stuck loop is a timeout: the probe must have one, and a short start must not fail it.
    assert 1 <= probe["timeoutSeconds"] < probe["periodSeconds"]
    assert probe["periodSeconds"] * probe["failureThreshold"] >= 20
    annotations = only(objects, "DaemonSet")["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(port)


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_a_headless_service_lists_every_host_pod_on_the_metrics_port(name):
    objects = render(name)
    service = only(objects, "Service")
    assert service["spec"]["clusterIP"] == "None"  # one endpoint per node, not a random one
    pod_labels = only(objects, "DaemonSet")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    [port] = service["spec"]["ports"]
    assert port["name"] == "metrics" and port["targetPort"] == "metrics"
    assert port["port"] == _metrics_port(objects)


def _monitoring_objects() -> List[Dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl (with its built-in kustomize) is not installed")
    result = subprocess.run([kubectl, "kustomize", str(MONITORING)], capture_output=True,
                            text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@pytest.mark.parametrize("version", [OLDEST_KUBERNETES, kubernetes_validate.latest_version()])
def test_the_monitoring_examples_select_the_host_pods_and_their_port(version):
    base = render("base")
    pod_labels = only(base, "DaemonSet")["spec"]["template"]["metadata"]["labels"]
    service = only(base, "Service")
    objects = _monitoring_objects()
    assert {o["kind"] for o in objects} == {"ServiceMonitor", "NetworkPolicy"}
    for obj in objects:
        assert obj["metadata"]["namespace"] == NAME

    monitor = only(objects, "ServiceMonitor")  # a CRD: no schema here, so checked by hand
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"][
        "labels"].items()
    assert monitor["spec"]["namespaceSelector"]["matchNames"] == [NAME]
    assert [(e["port"], e["path"]) for e in monitor["spec"]["endpoints"]] == [
        ("metrics", "/metrics")]
    pod_monitor = yaml.safe_load((MONITORING / "podmonitor.yaml").read_text())
    assert pod_monitor["kind"] == "PodMonitor"
    assert pod_monitor["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert [(e["port"], e["path"]) for e in pod_monitor["spec"]["podMetricsEndpoints"]] == [
        ("metrics", "/metrics")]

    policy = only(objects, "NetworkPolicy")
    kubernetes_validate.validate(policy, version, strict=True)
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= pod_labels.items()
    assert set(policy["spec"]["policyTypes"]) == {"Ingress", "Egress"}
    assert "egress" not in policy["spec"]  # the host dials no IP address
    [rule] = policy["spec"]["ingress"]
    assert rule["ports"] == [{"port": "metrics", "protocol": "TCP"}]
    assert rule["from"], "an ingress rule without 'from' admits everyone"


# -- security --------------------------------------------------------------------------------


def test_the_base_container_is_unprivileged_root_with_a_read_only_filesystem():
    objects = render("base")
    spec = pod_spec(objects)
    security = container(objects)["securityContext"]
    assert security["privileged"] is False
    assert security["allowPrivilegeEscalation"] is False
    assert security["readOnlyRootFilesystem"] is True
    assert security["capabilities"] == {"drop": ["ALL"]}
    assert spec["securityContext"]["runAsUser"] == 0
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    for flag in ("hostNetwork", "hostPID", "hostIPC"):
        assert not spec.get(flag, False), flag
    assert spec["automountServiceAccountToken"] is False
    by_path = mounts(objects)
    for path in ("/sys", "/dev", "/var/lib/kubelet/pod-resources", "/etc/device-plugin-host"):
        assert by_path[path].get("readOnly") is True, path


def test_only_the_fpga_overlay_is_privileged():
    privileged = {name for name in KUSTOMIZATIONS
                  if container(render(name))["securityContext"].get("privileged")}
    assert privileged == {"overlays/fpga-nodes"}


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_the_api_server_s_own_rules_hold(name):
    """Rules the API server enforces that are not in the OpenAPI schema."""
    objects = render(name)
    security = container(objects)["securityContext"]
    if security.get("privileged"):
        assert security.get("allowPrivilegeEscalation") is not False
    for path, mount in mounts(objects).items():
        if mount.get("recursiveReadOnly", "Disabled") != "Disabled":
            assert mount.get("readOnly") is True, path
    names = [v["name"] for v in pod_spec(objects)["volumes"]]
    assert len(names) == len(set(names))


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_the_pod_can_write_the_nfd_feature_file_and_the_device_info_files(name):
    """The default nfd_features_file is only written where its directory exists, and an sriov
    resource with device_info fails its Allocate when the files cannot be written: inside the
    pod both directories must be the node's own, writable."""
    import posixpath

    from host.config import HostSettings
    from host.outputs.devinfo import DEFAULT_DIR

    found = mounts(render(name))
    for directory in (posixpath.dirname(HostSettings().nfd_features_file), DEFAULT_DIR):
        assert directory in found, directory
        mount = found[directory]
        assert not mount.get("readOnly"), directory
        assert mount["volume"]["hostPath"]["path"] == directory, directory


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_udevd_is_invisible_to_a_pod_outside_the_host_network(name):
    """host/triggers/uevents.py listens to udevd's events when /run/udev/control exists, and to the
    kernel's otherwise. udevd's events never reach a pod's own network namespace, the kernel's
    do: mounting /run/udev without hostNetwork would silently lose every hot-plug event."""
    objects = render(name)
    if pod_spec(objects).get("hostNetwork"):
        return
    for path in mounts(objects):
        for control in ("/run/udev/control", "/var/run/udev/control"):
            assert not (control + "/").startswith(path.rstrip("/") + "/"), path


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_the_termination_message_is_written_to_a_writable_volume(name):
    """The default /dev/termination-log lands in the host's /dev mount, read-only here."""
    objects = render(name)
    path = container(objects)["terminationMessagePath"]
    assert not path.startswith("/dev/")
    mount = mounts(objects)[posixpath.dirname(path)]
    assert "emptyDir" in mount["volume"]
    assert not mount.get("readOnly", False)


# -- scheduling and updates ------------------------------------------------------------------


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_the_daemonset_is_node_critical_and_rolls_by_hand_over(name):
    objects = render(name)
    daemonset = only(objects, "DaemonSet")
    spec = pod_spec(objects)
    assert spec["priorityClassName"] == "system-node-critical"
    strategy = daemonset["spec"]["updateStrategy"]
    assert strategy["type"] == "RollingUpdate"
    # The new pod starts beside the old one and the hosts hand the node over (no gap):
    # one new pod per node at a time, never a node without a serving host.
    assert strategy["rollingUpdate"]["maxSurge"] == 1
    assert strategy["rollingUpdate"]["maxUnavailable"] == 0
    env = {e["name"]: e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
           for c in spec["containers"] for e in c.get("env", ())}
    assert env["POD_UID"] == "metadata.uid"  # per-pod DRA socket names
    assert daemonset["spec"]["minReadySeconds"] > 0
    assert spec["nodeSelector"]["kubernetes.io/os"] == "linux"
    assert {"nvidia.com/gpu", "amd.com/gpu"} <= {t.get("key") for t in spec["tolerations"]}


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_resources_are_small_but_leave_the_idle_host_room(name):
    resources = container(render(name))["resources"]
    assert set(resources["requests"]) == {"cpu", "memory"}
    assert set(resources["limits"]) == {"cpu", "memory"}
    # The host idles at about 40 MiB RSS: an OOM kill of the device plugin is a node outage.
    assert _mebibytes(resources["limits"]["memory"]) >= 128
    assert _mebibytes(resources["requests"]["memory"]) <= _mebibytes(resources["limits"]["memory"])


def _mebibytes(quantity: str) -> float:
    number, unit = re.fullmatch(r"(\d+)(Mi|Gi)", quantity).groups()
    return int(number) * (1024 if unit == "Gi" else 1)


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_namespaced_objects_are_in_the_namespace_that_allows_host_paths(name):
    objects = render(name)
    namespace = only(objects, "Namespace")
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"
    for obj in objects:
        if obj["kind"] not in CLUSTER_SCOPED:
            assert obj["metadata"]["namespace"] == namespace["metadata"]["name"], obj["kind"]


def test_overlays_schedule_onto_their_own_nodes():
    for name in KUSTOMIZATIONS:
        if name == "base":
            continue
        spec = pod_spec(render(name))
        selector = dict(spec["nodeSelector"])
        selector.pop("kubernetes.io/os")
        assert selector or spec.get("affinity", {}).get("nodeAffinity"), name


def _nfd_pci_labels(root: Path, resource: ResourceConfig) -> set:
    """The feature.node.kubernetes.io/pci-<class>_<vendor>.present labels Node Feature
    Discovery puts on a node with these GPUs (class: base class and subclass, 4 hex digits)."""
    from drivers.gpu.driver import GpuDriver
    from host.core.hostfs import HostFS

    found = GpuDriver().discover(HostFS(str(root)), [resource])[resource.name]
    assert found
    return {f"feature.node.kubernetes.io/pci-{d.attributes['class'][2:6]}_"
            f"{d.attributes['vendor'][2:]}.present" for d in found}


def test_the_gpu_overlay_s_affinity_matches_the_classes_the_cards_report(tmp_path):
    """Each GPU's own PCI class, read by the gpu driver from captured and fake trees, is what
    the overlay's affinity and its note for AMD are built on."""
    from device_plugin_host_testing.machines import load_machine
    from host.sim.fake_gpu import add_amd_gpu
    from host.sim.tree import FakeTree

    load_machine("gpu-server-8x", tmp_path / "hgx")  # 8 x H100 SXM: 3D controllers
    nvidia = _nfd_pci_labels(tmp_path / "hgx", ResourceConfig("nvidia.com/gpu", "gpu",
                                                               {"vendor": "0x10de"}))
    affinity = pod_spec(render("overlays/gpu-nodes"))["affinity"]["nodeAffinity"]
    terms = affinity["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    keys = {e["key"] for term in terms for e in term["matchExpressions"]}
    assert nvidia <= keys

    tree = FakeTree(tmp_path / "amd")
    add_amd_gpu(tree, "0000:05:00.0", card=1, render=128)  # MI210: display controller
    add_amd_gpu(tree, "0000:15:00.0", card=2, render=129, device=0x74A1,
                pci_class=0x120000, product_name="AMD Instinct MI300X")
    amd = _nfd_pci_labels(tmp_path / "amd", ResourceConfig("amd.com/gpu", "gpu",
                                                           {"vendor": "0x1002"}))
    assert amd == {"feature.node.kubernetes.io/pci-0380_1002.present",
                   "feature.node.kubernetes.io/pci-1200_1002.present"}
    notes = [p for p in sorted(KUBE.glob("overlays/*/node-affinity.yaml"))
             if "Instinct" in p.read_text()]
    assert {p.parent.name for p in notes} == {"gpu-nodes", "dra"}
    for path in notes:  # every overlay that tells operators which labels AMD cards carry
        note = path.read_text()
        assert "pci-1200_1002" in note and "MI300X" in note, path
        assert "Instinct cards are class 0380" not in note, path  # the old, wrong rule


# -- the image -------------------------------------------------------------------------------


def test_the_base_image_tag_is_the_project_version():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    image = container(render("base"))["image"]
    assert image == f"registry.example.com/{NAME}:{project['version']}"


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_the_image_is_pinned_to_a_tag_or_digest(name):
    image = container(render(name))["image"]
    assert re.fullmatch(r"[a-z0-9.-]+(/[a-z0-9._-]+)+(:[\w][\w.-]*|@sha256:[0-9a-f]{64})", image)
    assert not image.endswith(":latest")


def test_the_containerfile_pins_python_and_runs_the_host_on_the_mounted_config():
    text = CONTAINERFILE.read_text()
    base = re.search(r"^ARG PYTHON_IMAGE=(\S+)$", text, re.M)
    assert base is not None
    # An exact patch release (3.12.N) on a named Debian release, optionally with a digest.
    assert re.fullmatch(
        rf"docker\.io/library/python:{re.escape(IMAGE_PYTHON)}\.\d+-slim-[a-z]+"
        r"(@sha256:[0-9a-f]{64})?",
        base.group(1),
    )
    assert [line.split()[1] for line in text.splitlines() if line.startswith("FROM ")] == [
        "${PYTHON_IMAGE}", "${PYTHON_IMAGE}"]
    assert containerfile_entrypoint() == ENTRYPOINT
    assert containerfile_entrypoint("CMD") == CMD
    # Root on purpose: the kubelet's directories and sockets are writable only by root.
    assert not re.search(r"^USER\s+(?!(root|0)\s*$)", text, re.M)
    # The pinned wheels, installed by the recipe deploy/container/build also runs.
    assert re.search(r"pip download --no-cache-dir --only-binary=:all: --constraint "
                     r"/tmp/constraints.txt", text)
    assert re.search(r"^RUN python /tmp/install /tmp/wheels/\*\.whl", text, re.M)


def test_the_containerfile_copies_paths_that_exist_and_are_sent_to_the_build():
    """A renamed directory must break this test, not the next image build; and the ignore file
    (an allow-list) must let every copied path into the build context."""
    allowed = {line[1:] for line in IGNOREFILE.read_text().splitlines() if line.startswith("!")}
    copied = set()
    for line in CONTAINERFILE.read_text().splitlines():
        if line.startswith("COPY ") and "--from=" not in line:
            copied.update(line.split()[1:-1])
    assert copied == allowed
    for source in copied:
        assert (REPO / source).exists(), source


def test_every_runtime_dependency_is_pinned_within_its_range():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    pins: Dict[str, str] = {}
    for line in CONSTRAINTS.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, version = line.partition("==")
        assert sep and version, f"not an exact pin: {line!r}"
        key = canonicalize_name(name)
        assert key not in pins, f"pinned twice: {name}"
        pins[key] = version
    environment = {**default_environment(), "python_version": IMAGE_PYTHON,
                   "python_full_version": f"{IMAGE_PYTHON}.0"}
    for text in project["dependencies"]:
        requirement = Requirement(text)
        if requirement.marker and not requirement.marker.evaluate(environment):
            continue
        version: Optional[str] = pins.get(canonicalize_name(requirement.name))
        assert version is not None, f"{requirement.name} is not pinned in {CONSTRAINTS.name}"
        assert requirement.specifier.contains(version), f"{requirement.name}=={version}: {text}"
