"""The image built by deploy/container/build, run as the DaemonSet runs it.

The container's options come from deploy/container/daemonset_run.py, which reads them from
deploy/kubernetes/base/daemonset.yaml: the unit tests here hold that the translation covers
every field the manifest sets, so the manifest and the container run cannot drift apart. The
run tests (podman and a built image needed, else skipped with the reason) start the image with
those options against a fake host tree and a kubelet simulator on this side of the mounts.
"""

from __future__ import annotations

import asyncio
import copy
import importlib.util
import json
import os
import posixpath
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, Iterator

import pytest

from host.sim import fake_gpu
from host.sim.kubelet import KubeletSimulator
from host.sim.tree import FakeTree

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location(
    "daemonset_run", REPO / "deploy" / "container" / "daemonset_run.py")
assert _spec is not None and _spec.loader is not None
daemonset_run = importlib.util.module_from_spec(_spec)
sys.modules["daemonset_run"] = daemonset_run
_spec.loader.exec_module(daemonset_run)

IMAGE = os.environ.get("DPH_IMAGE", "localhost/device-plugin-host:0.1.0-amd64")
CONFIG = REPO / "deploy" / "kubernetes" / "base" / "config.toml"


# -- the translation -------------------------------------------------------------------------


def _plan() -> Any:
    pod, container = daemonset_run.load()
    return daemonset_run.plan(pod, container, lambda p: "/host" + p, "/config")


def test_every_field_the_manifest_sets_is_translated_or_named_as_not_applicable():
    pod, container = daemonset_run.load()
    known = lambda kind: daemonset_run.HANDLED[kind] | set(  # noqa: E731
        daemonset_run.NOT_APPLICABLE.get(kind, {}))
    assert set(pod) <= known("pod")
    assert set(pod["securityContext"]) <= known("pod.securityContext")
    assert set(container) <= known("container")
    assert set(container["securityContext"]) <= known("container.securityContext")
    for mount in container["volumeMounts"]:
        assert set(mount) <= known("volumeMount")
    for volume in pod["volumes"]:
        assert set(volume) - {"name"} <= known("volume")


def test_the_run_applies_the_manifest_s_user_security_context_and_mounts():
    pod, container = daemonset_run.load()
    plan = _plan()
    options = plan.options
    security = {**pod["securityContext"], **container["securityContext"]}
    assert plan.user == f"{security['runAsUser']}:{security['runAsGroup']}"
    assert ("--read-only" in options) == security["readOnlyRootFilesystem"]
    assert ("--privileged" in options) == security["privileged"]
    assert (("no-new-privileges" in options)
            == (security["allowPrivilegeEscalation"] is False))
    dropped = [options[i + 1] for i, o in enumerate(options) if o == "--cap-drop"]
    assert dropped == security["capabilities"]["drop"]
    assert set(plan.mounts) == {m["mountPath"] for m in container["volumeMounts"]}
    for mount in container["volumeMounts"]:
        source, read_only = plan.mounts[mount["mountPath"]]
        volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
        if "hostPath" in volume:
            assert source == "/host" + volume["hostPath"]["path"]
            assert read_only == bool(mount.get("readOnly"))
    assert ("--network" in options and options[options.index("--network") + 1] == "none") \
        == (not pod["hostNetwork"])
    assert plan.probe == ("/healthz", 9400)


@pytest.mark.parametrize("where,key", [
    ("container", "workingDir"), ("securityContext", "procMount"), ("mount", "subPath"),
    ("pod", "hostPID")])
def test_a_field_the_translation_does_not_know_stops_the_run(where, key):
    pod, container = copy.deepcopy(daemonset_run.load())
    target = {"container": container, "securityContext": container["securityContext"],
              "mount": container["volumeMounts"][0], "pod": pod}[where]
    target[key] = "x"
    with pytest.raises(daemonset_run.Unhandled, match=key):
        daemonset_run.plan(pod, container, lambda p: p, "/config")


def test_the_env_is_passed_with_the_downward_api_fields_the_kubelet_would_fill_in():
    pod, container = daemonset_run.load()
    fields = {"metadata.uid": "u-1", "metadata.name": "dph-x", "metadata.namespace": "ns",
              "spec.nodeName": "n"}
    plan = daemonset_run.plan(pod, container, lambda p: p, "/config", fields)
    want = {}
    for item in container["env"]:
        ref = item.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
        want[item["name"]] = fields[ref] if ref else str(item["value"])
    assert plan.env == want and plan.env["POD_UID"] == "u-1"
    passed = [plan.options[i + 1] for i, o in enumerate(plan.options) if o == "--env"]
    assert passed == [f"{k}={v}" for k, v in want.items()]
    # Each run is a new pod: a new uid, so its sockets never collide with the previous one's.
    again = [daemonset_run.plan(pod, container, lambda p: p, "/config").env["POD_UID"]
             for _ in range(2)]
    assert again[0] != again[1]


def test_an_env_source_the_translation_does_not_know_stops_the_run():
    pod, container = copy.deepcopy(daemonset_run.load())
    container["env"].append({"name": "SECRET", "valueFrom": {"secretKeyRef": {"name": "s"}}})
    with pytest.raises(daemonset_run.Unhandled, match="SECRET"):
        daemonset_run.plan(pod, container, lambda p: p, "/config")


# -- the container ---------------------------------------------------------------------------


def _podman() -> str:
    podman = shutil.which("podman")
    if podman is None:
        pytest.skip("podman is not installed (deploy/container/build needs it to load the image)")
    if subprocess.run([podman, "image", "exists", IMAGE], check=False).returncode != 0:
        pytest.skip(f"no image {IMAGE} in podman's store: run deploy/container/build first")
    return podman


runtime_options = daemonset_run.runtime_options


@pytest.fixture
def node() -> Iterator[Dict[str, Path]]:
    """A host tree: two fake NVIDIA GPUs under sys/ and dev/, and a directory for every other
    hostPath the DaemonSet mounts (under /tmp: the kubelet socket's path must stay short)."""
    with tempfile.TemporaryDirectory(prefix="dphi-", dir="/tmp") as scratch:
        yield from _node(Path(scratch))


def _node(tmp_path: Path) -> Iterator[Dict[str, Path]]:
    tree = FakeTree(str(tmp_path / "root"))
    tree.numa_nodes(1)
    fake_gpu.add_nvidia_control_nodes(tree)
    for minor in range(2):
        fake_gpu.add_nvidia_gpu(tree, f"0000:{0x18 + 0x10 * minor:02x}:00.0", minor=minor,
                                numa_node=0)
    daemonset_run.prepare_host_root(tmp_path / "root")
    config = tmp_path / "config"
    config.mkdir()
    shutil.copy(CONFIG, config / "config.toml")
    yield {"root": tmp_path / "root", "config": config}


def _options(node: Dict[str, Path]) -> Any:
    pod, container = daemonset_run.load()
    return daemonset_run.plan(pod, container, daemonset_run.host_dirs(node["root"]),
                              str(node["config"]))


def test_demo_runs_in_the_image():
    podman = _podman()
    result = subprocess.run([podman, "run", "--rm", *runtime_options(), IMAGE, "demo"],
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "demo finished" in result.stdout


def test_discover_reads_the_host_tree_mounted_at_the_daemonset_s_paths(node):
    podman = _podman()
    plan = _options(node)
    result = subprocess.run(
        [podman, "run", "--rm", *runtime_options(), *plan.options, IMAGE,
         "discover", "--config", "/etc/device-plugin-host/config.toml", "--json"],
        capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    devices = json.loads(result.stdout)
    assert len([d for d in devices if "nvidia" in json.dumps(d).lower()]) >= 2, devices


def _probe(pid: int, port: int, path: str) -> int:
    """The liveness probe's GET, from inside the container's network namespace."""
    script = ("import urllib.request,sys;"
              f"print(urllib.request.urlopen('http://127.0.0.1:{port}{path}', timeout=5).status)")
    out = subprocess.run(["nsenter", "-t", str(pid), "-n", sys.executable, "-c", script],
                         capture_output=True, text=True, timeout=30, check=False)
    assert out.returncode == 0, out.stderr[-1000:]
    return int(out.stdout.strip())


def _assert_confined_as_the_manifest_says(pid: int, plan: Any) -> None:
    """The running process as the kernel sees it: the manifest's user, no capability, no
    privilege escalation, a read-only root and every mount read-only or not as declared."""
    pod, container = daemonset_run.load()
    security = {**pod["securityContext"], **container["securityContext"]}
    status = dict(line.split(":", 1) for line in
                  Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    assert status["Uid"].split()[0] == str(security["runAsUser"])
    assert status["Gid"].split()[0] == str(security["runAsGroup"])
    if security["capabilities"].get("drop") == ["ALL"] and not security["capabilities"].get("add"):
        assert int(status["CapEff"], 16) == 0 and int(status["CapBnd"], 16) == 0
    assert status["NoNewPrivs"].strip() == ("1" if not security["allowPrivilegeEscalation"]
                                            else "0")
    flags = {}
    for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines():
        fields = line.split()
        flags[fields[4]] = set(fields[5].split(","))  # the last mount at a path wins
    assert ("ro" in flags["/"]) == security["readOnlyRootFilesystem"]
    for path, (_, read_only) in plan.mounts.items():
        seen = _in_container(pid, path)
        assert ("ro" in flags[seen]) == read_only, (path, flags[seen])


def _in_container(pid: int, path: str) -> str:
    """``path`` with the image's symbolic links resolved (/var/run is /run in Debian)."""
    resolved = "/"
    for part in Path(path).parts[1:]:
        candidate = posixpath.join(resolved, part)
        link = Path(f"/proc/{pid}/root{candidate}")
        if link.is_symlink():
            target = os.readlink(link)
            candidate = posixpath.normpath(posixpath.join(resolved, target))
        resolved = candidate
    return resolved


def test_run_registers_with_a_kubelet_on_the_host_side_and_answers_its_probe(node):
    podman = _podman()
    plan = _options(node)
    plugin_dir = node["root"] / "var/lib/kubelet/device-plugins"
    name = f"dph-test-{os.getpid()}"

    async def scenario() -> None:
        async with KubeletSimulator(str(plugin_dir)) as kubelet:
            started = subprocess.run(
                [podman, "run", "-d", "--name", name, *runtime_options(), *plan.options,
                 IMAGE, *plan.arguments], capture_output=True, text=True, timeout=120,
                check=False)
            assert started.returncode == 0, started.stderr[-2000:]
            try:
                await kubelet.wait_for(
                    lambda k: any(r.connected and r.snapshots and r.allocatable
                                  for r in k.resources.values()),
                    timeout=60, what="a resource registered from the container")
                resource = next(n for n, r in kubelet.resources.items() if r.allocatable)
                result = await kubelet.allocate(resource, 1, pod="p1")
                assert len(result.device_ids) == 1
                assert any(d.host_path.startswith("/dev/nvidia")
                           for d in result.response.devices), result.response
                pid = int(subprocess.run(
                    [podman, "inspect", "-f", "{{.State.Pid}}", name], capture_output=True,
                    text=True, check=True).stdout)
                assert plan.probe is not None
                assert _probe(pid, plan.probe[1], plan.probe[0]) == 200
                _assert_confined_as_the_manifest_says(pid, plan)
            finally:
                logs = subprocess.run([podman, "logs", name], capture_output=True, text=True,
                                      check=False)
                subprocess.run([podman, "rm", "-f", "-t", "5", name], capture_output=True,
                               check=False)
                print(logs.stdout[-3000:], logs.stderr[-3000:])

    asyncio.run(scenario())
