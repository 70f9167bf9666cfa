"""A whole node on this machine: containerd 1.7 (CDI on) behind an oomScoreAdj-clamping runc
wrapper, etcd + kube-apiserver + kube-scheduler + kube-controller-manager, and the real kubelet,
named after this machine's hostname (../shared/k8s/README.md, "A whole node").

``Node.start()`` brings it up, ``Node.close()`` takes it all down by pid: the kubelet, every CRI
task and container (``ctr``), containerd, the control plane; then the mounts left under
``/var/lib/kubelet`` and containerd's root, the CNI bridge and the device nodes made here with
``mknod``. ``close()`` also runs first in ``start()``, so what a killed earlier run left goes.

Containers are checked from inside: a pod's containers print ``ls /dev``, their environment and
their mounts, and the test reads the container's log file under ``/var/log/pods``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import importlib.util
import io
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tarfile
import time
import uuid
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import psutil

REPO = Path(__file__).resolve().parents[2]
# ../shared/k8s beside the project (DPH_SHARED_K8S names another place, for a worktree).
SHARED_K8S = Path(os.environ.get("DPH_SHARED_K8S") or REPO.parent / "shared" / "k8s")
SETUP_RUNTIME = Path(__file__).with_name("setup-runtime")
WORK = Path("/var/lib/dph-node-test")
RUN = Path("/run/dph-node-test")
CONTAINERD_SOCK = RUN / "containerd.sock"
KUBELET_ROOT = Path("/var/lib/kubelet")
POD_LOGS = Path("/var/log/pods")
IMAGE = "docker.io/library/dph-busybox:node-test"
BRIDGE = "dphbr0"
SUBNET = "10.244.77.0/24"
NS = "k8s.io"
HOSTNAME = socket.gethostname().lower()
CDI_DIR = Path("/var/run/cdi")
PLUGIN_DIR = KUBELET_ROOT / "device-plugins"
# The tests' GPU machine: 8 H100s, 0-3 on NUMA node 0, 4-7 on NUMA node 1.
MACHINE = "gpu-server-8x"
GPU_ADDRESSES = ["0000:18:00.0", "0000:2a:00.0", "0000:3a:00.0", "0000:5d:00.0",
                 "0000:9a:00.0", "0000:ab:00.0", "0000:ba:00.0", "0000:db:00.0"]
WAIT_S = 60.0
# Made when the suite first takes /var/lib/kubelet and /var/log/pods; removed with them.
OURS = WORK / "owns-kubelet-root"


def _dra_helpers() -> Any:
    """tests/dra/test_dra_real_scheduler.py: its API client, control-plane start, overlay
    readers (one copy of them for both suites)."""
    path = REPO / "tests" / "dra" / "test_dra_real_scheduler.py"
    spec = importlib.util.spec_from_file_location("dph_dra_real_scheduler", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


dra = _dra_helpers()
until = dra._until


def skip_reason() -> Optional[str]:
    """Why the node cannot run here, or None."""
    if os.geteuid() != 0:
        return "node tests need root (the kubelet, containerd, mknod, mounts)"
    if not (SHARED_K8S / "kubelet.xz").is_file():
        return f"no {SHARED_K8S}/kubelet.xz (../shared/k8s holds the real kubelet)"
    if not os.path.isdir("/sys/fs/cgroup"):
        return "no /sys/fs/cgroup"
    if not OURS.exists():
        for path in (KUBELET_ROOT, POD_LOGS):
            if path.exists():
                return (f"{path} exists and is not this suite's: a node of its own may run "
                        "here (the suite takes it over and removes it at the end)")
    others = _foreign_runtime()
    if others:
        return f"a kubelet or containerd of this machine's own runs (pid {others[0]})"
    setup = subprocess.run([str(SETUP_RUNTIME)], capture_output=True, text=True, check=False)
    if setup.returncode != 0:
        return ("the container runtime cannot be installed: "
                + (setup.stderr.strip().splitlines() or ["setup-runtime failed"])[-1])
    return None


def unpack_assets() -> str:
    out = subprocess.run([str(SHARED_K8S / "unpack")], capture_output=True, text=True,
                         check=True)
    return out.stdout.strip().splitlines()[-1]


# ---------------------------------------------------------------- image, configs


def busybox_archive(path: Path) -> None:
    """A one-layer docker-archive: static busybox, its applet links, /etc/passwd. Its default
    command (the pod sandbox's) sleeps until SIGTERM."""
    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w") as tar:
        def add_dir(name: str) -> None:
            info = tarfile.TarInfo(name)
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(info)
        for name in ("bin", "etc", "tmp", "proc", "sys", "dev"):
            add_dir(name)
        tar.add("/bin/busybox", "bin/busybox")
        applets = subprocess.run(["/bin/busybox", "--list"], capture_output=True, text=True,
                                 check=True).stdout.split()
        for applet in applets:
            if applet == "busybox":
                continue
            info = tarfile.TarInfo(f"bin/{applet}")
            info.type, info.linkname, info.mode = tarfile.SYMTYPE, "busybox", 0o777
            tar.addfile(info)
        passwd = b"root:x:0:0:root:/:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/sh\n"
        info = tarfile.TarInfo("etc/passwd")
        info.size, info.mode = len(passwd), 0o644
        tar.addfile(info, io.BytesIO(passwd))
    layer_bytes = layer.getvalue()
    digest = hashlib.sha256(layer_bytes).hexdigest()
    config = json.dumps({
        "architecture": "amd64", "os": "linux",
        "config": {"Env": ["PATH=/bin"], "Cmd": [
            "/bin/sh", "-c", "trap 'exit 0' TERM; while :; do sleep 3600 & wait; done"]},
        "rootfs": {"type": "layers", "diff_ids": [f"sha256:{digest}"]},
    }).encode()
    config_name = hashlib.sha256(config).hexdigest() + ".json"
    manifest = json.dumps([{"Config": config_name, "RepoTags": [IMAGE.split("/", 2)[2]],
                            "Layers": [f"{digest}/layer.tar"]}]).encode()
    with tarfile.open(path, "w") as tar:
        for name, data in ((f"{digest}/layer.tar", layer_bytes), (config_name, config),
                           ("manifest.json", manifest)):
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))


RUNC_WRAPPER = """#!/bin/sh
# runc with the bundle's process.oomScoreAdj clamped to 0 for create/run: root here lacks
# CAP_SYS_RESOURCE, and a negative value fails every sandbox in runc's nsexec.
bundle=.
cmd=""
prev=""
for arg in "$@"; do
    case "$prev" in --bundle|-b) bundle=$arg ;; esac
    case "$arg" in
        --bundle=*) bundle=${arg#--bundle=} ;;
        create|run) [ -z "$cmd" ] && cmd=$arg ;;
    esac
    prev=$arg
done
if [ -n "$cmd" ] && [ -f "$bundle/config.json" ]; then
    sed -i -E 's/"oomScoreAdj":-[0-9]+/"oomScoreAdj":0/' "$bundle/config.json"
fi
exec /usr/sbin/runc "$@"
"""


def containerd_config(wrapper: Path, cni_conf: Path) -> str:
    cri = 'plugins."io.containerd.grpc.v1.cri"'
    return f"""version = 2
root = "{WORK / 'containerd'}"
state = "{RUN / 'containerd'}"
[grpc]
  address = "{CONTAINERD_SOCK}"
[ttrpc]
  address = "{CONTAINERD_SOCK}.ttrpc"
[debug]
  address = ""
[{cri}]
  sandbox_image = "{IMAGE}"
  enable_cdi = true
  cdi_spec_dirs = ["/etc/cdi", "/var/run/cdi"]
  [{cri}.containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [{cri}.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [{cri}.containerd.runtimes.runc.options]
        BinaryName = "{wrapper}"
        SystemdCgroup = false
  [{cri}.cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "{cni_conf}"
"""


CNI_CONFLIST = {
    "cniVersion": "1.0.0", "name": "dph-node-test",
    "plugins": [
        {"type": "bridge", "bridge": BRIDGE, "isGateway": True, "ipMasq": False,
         "ipam": {"type": "host-local", "ranges": [[{"subnet": SUBNET}]],
                  "dataDir": str(RUN / "cni-ipam")}},
        {"type": "loopback"},
    ],
}


def kubelet_config() -> str:
    return f"""apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
failCgroupV1: false
cgroupDriver: cgroupfs
containerRuntimeEndpoint: unix://{CONTAINERD_SOCK}
failSwapOn: false
authentication:
  anonymous: {{enabled: true}}
  webhook: {{enabled: false}}
authorization: {{mode: AlwaysAllow}}
evictionHard: {{memory.available: "1Mi", nodefs.available: "1%", nodefs.inodesFree: "1%",
               imagefs.available: "1%"}}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
serializeImagePulls: false
resolvConf: ""
"""


# ---------------------------------------------------------------- processes


class Proc:
    """A child process in its own session, logging to a file; stopped by its pid."""

    def __init__(self, name: str, args: Sequence[str], log_dir: Path,
                 env: Optional[Dict[str, str]] = None) -> None:
        self.name = name
        self.args = list(args)
        self.log_path = log_dir / f"{name}.log"
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT,
                                         env=env, cwd=REPO, start_new_session=True)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20) -> Optional[int]:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        return self.proc.returncode


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _pids_of(exe_prefixes: Sequence[str]) -> List[int]:
    """Processes whose executable is one of ``exe_prefixes`` (what an earlier run of ours left:
    containerd-shim-runc-v2 for our containerd's socket, the kubelet from the unpacked
    assets)."""
    return [pid for pid, argv in _command_lines()
            if any(prefix in " ".join(argv) for prefix in exe_prefixes)]


def _command_lines() -> Iterator[Tuple[int, List[str]]]:
    """(pid, argv) of every process with a command line (kernel threads have none)."""
    for process in psutil.process_iter(["cmdline"]):
        argv = process.info["cmdline"]
        if argv:
            yield process.pid, argv


def _kill_pids(pids: Sequence[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while any(_pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)


def mounts_under(*roots: Path) -> List[str]:
    out = []
    with open("/proc/self/mounts", encoding="utf-8") as handle:
        for line in handle:
            target = line.split()[1].encode().decode("unicode_escape")
            if any(target == str(r) or target.startswith(f"{r}/") for r in roots):
                out.append(target)
    return out


def bridge_exists() -> bool:
    return os.path.exists(f"/sys/class/net/{BRIDGE}")


# ---------------------------------------------------------------- the node


class Node:
    """The whole node; ``api`` speaks JSON to its API server."""

    def __init__(self, assets: str) -> None:
        self.assets = assets
        self.logs = WORK / "logs"
        self.server: Any = None
        self.components: List[Any] = []
        self.api: Any = None
        self.containerd: Optional[Proc] = None
        self.kubelet: Optional[Proc] = None
        self.made_nodes: List[str] = []
        self.made_dirs: List[str] = []
        self.tree = WORK / "tree"

    # -- start

    def start(self) -> None:
        self.close()  # whatever a killed earlier run left
        for directory in (WORK, RUN, self.logs, WORK / "cni", RUN / "cni-ipam"):
            directory.mkdir(parents=True, exist_ok=True, mode=0o755)
        OURS.touch(mode=0o644)
        self._devices()
        self._start_containerd()
        self._start_control_plane()
        self.start_kubelet()
        until("Node Ready and schedulable", self._node_ready, timeout=90, every=0.5)

    def _devices(self) -> None:
        """The GPU machine's tree, and its /dev/nvidia* paths made real (harmless c 1 3)."""
        from device_plugin_host_testing.machines import load_machine

        shutil.rmtree(self.tree, ignore_errors=True)
        load_machine(MACHINE, self.tree)
        for line in machine_lines():
            if not line.startswith("c /dev/nvidia") or "nvswitch" in line:
                continue
            path = line.split()[1]
            parent = os.path.dirname(path)
            if not os.path.isdir(parent):
                os.makedirs(parent, mode=0o755)
                self.made_dirs.append(parent)
            if not os.path.lexists(path):
                os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
                self.made_nodes.append(path)
        _record(WORK / "mknod.json", {"nodes": self.made_nodes, "dirs": self.made_dirs})

    def _start_containerd(self) -> None:
        wrapper = WORK / "runc-wrapper"
        wrapper.write_text(RUNC_WRAPPER)
        wrapper.chmod(0o755)
        cni = WORK / "cni" / "net.d"
        cni.mkdir(parents=True, exist_ok=True)
        (cni / "10-dph.conflist").write_text(json.dumps(CNI_CONFLIST))
        config = WORK / "containerd.toml"
        config.write_text(containerd_config(wrapper, cni))
        self.containerd = Proc("containerd", ["containerd", "--config", str(config)], self.logs)
        _record(RUN / "containerd.pid", {"pid": self.containerd.pid})
        until("containerd serving", lambda: self._ctr("version", check=False).returncode == 0
              or not self._alive(self.containerd), timeout=30, every=0.1)
        assert self._alive(self.containerd), f"containerd exited:\n{self.containerd.log_tail()}"
        archive = WORK / "busybox.tar"
        busybox_archive(archive)
        self._ctr("images", "import", str(archive))

    def import_image(self, layout: Path, tag: str, ref: str) -> str:
        """The image ``tag`` of the OCI layout ``layout`` (deploy/container/build's) imported
        into the node's containerd as ``ref``, as an operator loads it without a registry."""
        index = json.loads((layout / "index.json").read_text())
        [manifest] = [m for m in index["manifests"]
                      if (m.get("annotations") or {}).get("org.opencontainers.image.ref.name")
                      == tag]
        manifest = dict(manifest, annotations={"io.containerd.image.name": ref,
                                               "org.opencontainers.image.ref.name": tag})
        archive = WORK / "image.tar"
        with tarfile.open(archive, "w") as tar:
            tar.add(layout / "oci-layout", "oci-layout")
            tar.add(layout / "blobs", "blobs")
            data = json.dumps({"schemaVersion": 2, "manifests": [manifest]}).encode()
            info = tarfile.TarInfo("index.json")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        try:
            self._ctr("images", "import", str(archive))
        finally:
            archive.unlink()
        return ref

    @staticmethod
    def _alive(proc: Optional[Proc]) -> bool:
        return proc is not None and proc.alive()

    def _ctr(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(["ctr", "--address", str(CONTAINERD_SOCK), "-n", NS, *args],
                              capture_output=True, text=True, check=check, timeout=60)

    def _start_control_plane(self) -> None:
        from host.sim.apiserver import RealApiServer

        self.server = RealApiServer(self.assets, device_taints=True)
        self.server.start()
        self.api = dra.Api(self.server)
        certs = os.path.dirname(self.server.ca_path)
        self.components = [
            dra._control_plane_component("kube-scheduler", self.assets, self.server,
                                         str(self.logs), []),
            dra._control_plane_component("kube-controller-manager", self.assets, self.server,
                                         str(self.logs), [
                "--controllers=*",
                f"--service-account-private-key-file={os.path.join(certs, 'sa.key')}",
                f"--root-ca-file={self.server.ca_path}",
                "--use-service-account-credentials=false"]),
        ]
        _record(RUN / "control-plane.pid", {"pids": [c.proc.pid for c in self.components] + [
            p.pid for p in (self.server._etcd, self.server._apiserver) if p is not None],
            "dir": self.server._dir})
        for device_class in dra.overlay_device_classes():
            self.api.create("/apis/resource.k8s.io/v1/deviceclasses", device_class)

    def start_kubelet(self) -> None:
        config = WORK / "kubelet.yaml"
        config.write_text(kubelet_config())
        self.kubelet = Proc("kubelet", [
            os.path.join(self.assets, "kubelet"), "--config", str(config),
            "--kubeconfig", self.server.kubeconfig_path, "--root-dir", str(KUBELET_ROOT),
            "--v=1"], self.logs)
        _record(RUN / "kubelet.pid", {"pid": self.kubelet.pid})

    def stop_kubelet(self) -> None:
        if self.kubelet is not None:
            self.kubelet.stop()

    def _node_ready(self) -> bool:
        if not self._alive(self.kubelet):
            assert self.kubelet is not None
            raise AssertionError(f"kubelet exited:\n{self.kubelet.log_tail()}")
        node = self.api.request("GET", f"/api/v1/nodes/{HOSTNAME}", ok=(200, 404))
        if node.get("kind") == "Status":
            return False
        ready = any(c["type"] == "Ready" and c["status"] == "True"
                    for c in node.get("status", {}).get("conditions") or ())
        return ready and not node.get("spec", {}).get("taints")

    # -- tear down

    def close(self) -> None:
        """Everything down, by pid; then mounts, bridge and device nodes."""
        for pid in _recorded_pids(RUN / "hosts.pid"):  # hosts a killed run left
            if _pid_alive(pid) and _is_ours(pid, str(self.tree)):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
                deadline = time.monotonic() + 10
                while _pid_alive(pid) and time.monotonic() < deadline:
                    time.sleep(0.05)
                _kill_pids([pid] if _pid_alive(pid) else [])
        if self.kubelet is not None:
            self.kubelet.stop()
        for pid in _recorded_pids(RUN / "kubelet.pid"):
            _kill_pids([pid] if _pid_alive(pid) and _is_ours(pid, "kubelet") else [])
        if CONTAINERD_SOCK.exists():
            with contextlib.suppress(Exception):
                self._remove_containers()
        shims = _pids_of([f"-address {CONTAINERD_SOCK}", str(RUN / "containerd")])
        if self.containerd is not None:
            self.containerd.stop()
        for pid in _recorded_pids(RUN / "containerd.pid"):
            _kill_pids([pid] if _pid_alive(pid) and _is_ours(pid, "containerd") else [])
        _kill_pids([p for p in shims if _pid_alive(p)])
        for component in getattr(self, "components", []):
            component.stop()
        for pid in _recorded_pids(RUN / "control-plane.pid"):
            _kill_pids([pid] if _pid_alive(pid) and (_is_ours(pid, "kube-")
                                                     or _is_ours(pid, "etcd")) else [])
        left = (_read(RUN / "control-plane.pid") or {}).get("dir")
        if left and os.path.basename(left).startswith("dph-envtest-"):
            shutil.rmtree(left, ignore_errors=True)  # a killed run's etcd data and certs
        if getattr(self, "server", None) is not None:
            self.server.close()
            self.server = None
        self.kubelet = self.containerd = None
        self.components = []
        for target in sorted(mounts_under(KUBELET_ROOT, WORK / "containerd", RUN),
                             key=len, reverse=True):
            subprocess.run(["umount", "-l", target], capture_output=True, check=False)
        if bridge_exists():
            subprocess.run(["ip", "link", "delete", BRIDGE], capture_output=True, check=False)
        record = _read(WORK / "mknod.json") or {}
        for path in record.get("nodes", []) + self.made_nodes:
            with contextlib.suppress(FileNotFoundError):
                if stat.S_ISCHR(os.lstat(path).st_mode) and os.lstat(path).st_rdev == \
                        os.makedev(1, 3):
                    os.unlink(path)
        for path in reversed(record.get("dirs", []) + self.made_dirs):
            with contextlib.suppress(OSError):
                os.rmdir(path)
        self.made_nodes, self.made_dirs = [], []
        with contextlib.suppress(FileNotFoundError):
            (WORK / "mknod.json").unlink()
        shutil.rmtree(RUN, ignore_errors=True)
        shutil.rmtree(WORK / "containerd", ignore_errors=True)
        if OURS.exists():  # a node of the machine's own is never touched (skip_reason)
            shutil.rmtree(KUBELET_ROOT, ignore_errors=True)
            shutil.rmtree(POD_LOGS, ignore_errors=True)
            for name in _listdir(CDI_DIR):  # the specs our hosts wrote
                if name.startswith("device-plugin-host"):
                    with contextlib.suppress(OSError):
                        os.unlink(CDI_DIR / name)
            with contextlib.suppress(OSError):
                CDI_DIR.rmdir()  # when empty
            OURS.unlink()

    def _remove_containers(self) -> None:
        tasks = self._ctr("tasks", "ls", "-q", check=False).stdout.split()
        for task in tasks:
            self._ctr("tasks", "kill", "-s", "SIGKILL", task, check=False)
        for task in tasks:
            for _ in range(50):
                if self._ctr("tasks", "delete", task, check=False).returncode == 0:
                    break
                time.sleep(0.1)
        for container in self._ctr("containers", "ls", "-q", check=False).stdout.split():
            self._ctr("containers", "delete", container, check=False)

    # -- helpers for tests

    def kill_container(self, pod: Dict[str, Any], container: str) -> None:
        """SIGKILL one container's task, as a crash would."""
        status = next(s for s in pod["status"]["containerStatuses"] if s["name"] == container)
        cid = status["containerID"].split("://", 1)[1]
        self._ctr("tasks", "kill", "-s", "SIGKILL", cid)

    def kill_all_tasks(self) -> None:
        for task in self._ctr("tasks", "ls", "-q", check=False).stdout.split():
            self._ctr("tasks", "kill", "-s", "SIGKILL", task, check=False)


def _record(path: Path, data: Dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


def _read(path: Path) -> Optional[Dict[str, Any]]:
    try:
        return json.loads(path.read_text())  # type: ignore[no-any-return]
    except (OSError, ValueError):
        return None


def _recorded_pids(path: Path) -> List[int]:
    data = _read(path) or {}
    return [int(p) for p in ([data["pid"]] if "pid" in data else data.get("pids", []))]


def _foreign_runtime() -> List[int]:
    """Running kubelets and containerds not started with this suite's config."""
    return [pid for pid, argv in _command_lines()
            if os.path.basename(argv[0]) in ("kubelet", "containerd")
            and str(WORK) not in " ".join(argv)]


def _is_ours(pid: int, name: str) -> bool:
    try:
        return name in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False


def machine_lines() -> List[str]:
    from device_plugin_host_testing.machines import MACHINES

    path = MACHINES / f"{MACHINE}.tree"
    return path.read_text().splitlines()


# ---------------------------------------------------------------- pods

PROBE = ("echo '--- dev'; ls -1 /dev /dev/nvidia-caps 2>/dev/null; echo '--- env'; env; "
         "echo '--- mounts'; cat /proc/self/mounts; echo '--- end'; "
         "trap 'exit 0' TERM; while :; do sleep 3600 & wait; done")


def container(name: str, limits: Optional[Dict[str, Any]] = None,
              claims: Optional[List[Dict[str, str]]] = None) -> Dict[str, Any]:
    spec: Dict[str, Any] = {"name": name, "image": IMAGE, "imagePullPolicy": "Never",
                            "command": ["/bin/sh", "-c", PROBE]}
    resources: Dict[str, Any] = {}
    if limits:
        resources["limits"] = limits
    if claims:
        resources["claims"] = claims
    if resources:
        spec["resources"] = resources
    return spec


class Seen:
    """What one container printed about itself."""

    def __init__(self, text: str) -> None:
        self.text = text
        sections: Dict[str, List[str]] = {}
        current = ""
        for line in text.splitlines():
            if line.startswith("--- "):
                current = line[4:]
                sections[current] = []
            elif current:
                sections[current].append(line)
        self.dev = {line for line in sections.get("dev", []) if line and not line.endswith(":")}
        self.env = dict(line.split("=", 1) for line in sections.get("env", []) if "=" in line)
        self.mounts = sections.get("mounts", [])
        self.complete = "end" in sections

    @property
    def gpus(self) -> List[str]:
        return sorted(d for d in self.dev if d.startswith("nvidia") and d[6:].isdigit())

    @property
    def visible(self) -> List[str]:
        value = self.env.get("NVIDIA_VISIBLE_DEVICES", "")
        return sorted(v for v in value.split(",") if v)


def read_log(namespace: str, pod: str, uid: str, name: str, restart: int) -> str:
    path = POD_LOGS / f"{namespace}_{pod}_{uid}" / name / f"{restart}.log"
    try:
        raw = path.read_text(errors="replace")
    except OSError:
        return ""
    out = []
    for line in raw.splitlines():
        parts = line.split(" ", 3)  # TIMESTAMP STREAM TAG text
        if len(parts) == 4:
            out.append(parts[3])
    return "\n".join(out)


class Pods:
    """One test's pods in its own namespace, on the node."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.api = node.api
        self.namespace = f"t-{uuid.uuid4().hex[:8]}"
        self.api.create("/api/v1/namespaces", {"metadata": {"name": self.namespace}})
        self.created: Dict[str, float] = {}

    @property
    def ns(self) -> str:
        return f"/api/v1/namespaces/{self.namespace}"

    @property
    def rs(self) -> str:
        return f"/apis/resource.k8s.io/v1/namespaces/{self.namespace}"

    def create(self, name: str, containers: List[Dict[str, Any]],
               claims: Optional[List[Dict[str, Any]]] = None, bind: bool = True) -> None:
        spec: Dict[str, Any] = {"containers": containers, "terminationGracePeriodSeconds": 1,
                                "automountServiceAccountToken": False,
                                "enableServiceLinks": False}
        if bind:
            spec["nodeName"] = HOSTNAME
        if claims:
            spec["resourceClaims"] = claims
        self.submit({"name": name}, spec)

    def submit(self, metadata: Dict[str, Any], spec: Dict[str, Any]) -> None:
        """A pod of a whole spec (a manifest's template) in this namespace."""
        self.created[metadata["name"]] = time.monotonic()
        self.api.create(f"{self.ns}/pods", {"metadata": metadata, "spec": spec})

    def get(self, name: str) -> Dict[str, Any]:
        return self.api.get(f"{self.ns}/pods/{name}")  # type: ignore[no-any-return]

    def running(self, name: str, timeout: float = WAIT_S) -> Dict[str, Any]:
        """The pod once every container is running; an admission failure raises at once."""
        def probe() -> Optional[Dict[str, Any]]:
            pod = self.get(name)
            status = pod.get("status", {})
            if status.get("phase") == "Failed":
                raise AssertionError(f"pod {name} failed: {status.get('reason')}: "
                                     f"{status.get('message')}")
            statuses = status.get("containerStatuses") or []
            for s in statuses:
                waiting = s.get("state", {}).get("waiting") or {}
                if waiting.get("reason") in ("CreateContainerError", "CreateContainerConfigError",
                                             "ErrImageNeverPull", "RunContainerError"):
                    raise AssertionError(f"pod {name} {s['name']}: {waiting}")
            if statuses and all("running" in s.get("state", {}) for s in statuses) \
                    and len(statuses) == len(pod["spec"]["containers"]):
                return pod
            return None
        try:
            return until(f"pod {name} running", probe, timeout=timeout, every=0.1)  # type: ignore
        except AssertionError as error:
            status = self.get(name).get("status", {})
            raise AssertionError(f"{error}; status {json.dumps(status)}; events "
                                 f"{self.events(name)}") from None

    def seen(self, name: str, container_name: str, restart: Optional[int] = None) -> Seen:
        """What the container printed (its current run, or run ``restart``)."""
        def probe() -> Optional[Seen]:
            pod = self.get(name)
            count = restart
            if count is None:
                count = next(s["restartCount"] for s in pod["status"]["containerStatuses"]
                             if s["name"] == container_name)
            seen = Seen(read_log(self.namespace, name, pod["metadata"]["uid"], container_name,
                                 count))
            return seen if seen.complete else None
        return until(f"{name}/{container_name} output", probe, timeout=30)  # type: ignore

    def events(self, name: str) -> List[str]:
        items = self.api.get(f"{self.ns}/events")["items"]
        return [f"{e.get('reason')}: {e.get('message')}" for e in items
                if e["involvedObject"].get("name") == name]

    def delete_all(self) -> None:
        """Every pod of the namespace deleted (gracefully: a forced delete leaves the kubelet
        to unprepare after the API object is gone) and gone, every claim's CDI spec removed
        (the kubelet unprepared it), then the namespace."""
        claims = [c["metadata"]["uid"] for c in self.api.get(f"{self.rs}/resourceclaims")["items"]]
        for pod in self.api.get(f"{self.ns}/pods")["items"]:
            self.api.request("DELETE", f"{self.ns}/pods/{pod['metadata']['name']}",
                             ok=(200, 202, 404))
        until("pods gone", lambda: not self.api.get(f"{self.ns}/pods")["items"], timeout=60,
              every=0.2)
        until("claims unprepared", lambda: not any(
            uid in name for uid in claims for name in _listdir(CDI_DIR)), timeout=60, every=0.1)
        self.api.request("DELETE", f"/api/v1/namespaces/{self.namespace}", ok=(200, 202, 404))


def _listdir(path: Path) -> List[str]:
    try:
        return os.listdir(path)
    except FileNotFoundError:
        return []


# ---------------------------------------------------------------- our host


class Host:
    """``device-plugin-host run`` on the node's GPU tree, with a config of the test's."""

    def __init__(self, node: Node, work: Path, resources: str,
                 settings: Optional[Dict[str, Any]] = None,
                 argv: Optional[List[str]] = None) -> None:
        self.node = node
        self.work = work
        work.mkdir(parents=True, exist_ok=True)
        host = {
            "node_name": HOSTNAME, "kubeconfig": node.server.kubeconfig_path,
            "metrics_address": "", "nfd_features_file": "",
            "drain_file": str(work / "state" / "drained"),
            "dra_state_dir": str(RUN / "host-dra"),
            **(settings or {}),
        }
        self.config = work / "config.toml"
        self.config.write_text("[host]\n" + "".join(f"{k} = {json.dumps(v)}\n"
                                                   for k, v in host.items())
                               + "\n" + resources)
        self.argv = argv or [sys.executable, "-m", "host", "run", "--config",
                             str(self.config)]
        self.argv = [*self.argv, "--host-root", str(node.tree)]
        self.proc: Optional[Proc] = None

    def start(self) -> Host:
        env = dict(os.environ, PYTHONPATH=str(REPO))
        self.proc = Proc(f"host-{self.work.name}", self.argv, self.work, env=env)
        record = _read(RUN / "hosts.pid") or {}
        _record(RUN / "hosts.pid", {"pids": [*record.get("pids", []), self.proc.pid]})
        return self

    def alive(self) -> bool:
        if self.proc is None or not self.proc.alive():
            raise AssertionError("device-plugin-host exited:\n"
                                 + (self.proc.log_tail() if self.proc else ""))
        return True

    def stop(self) -> Optional[int]:
        return None if self.proc is None else self.proc.stop()

    def logged(self, text: str) -> bool:
        assert self.proc is not None
        with contextlib.suppress(OSError):
            return text in self.proc.log_path.read_text(errors="replace")
        return False

    def dra_registered(self) -> bool:
        """The kubelet's plugin watcher accepted this host's DRA driver (its
        NotifyRegistrationStatus, as the host logs it)."""
        return self.logged("registered with the kubelet's plugin watcher")

    def cli(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "host", *args], capture_output=True,
                              text=True, check=False, cwd=REPO, timeout=60,
                              env=dict(os.environ, PYTHONPATH=str(REPO)))


def kubelet_allocatable() -> Dict[str, List[str]]:
    """The kubelet's own view of every device plugin resource's healthy devices (PodResources
    GetAllocatableResources): fresh at registration, unlike the Node's status."""
    from host.kubelet.podresources import PodResourcesClient

    async def fetch() -> Dict[str, List[str]]:
        async with PodResourcesClient(str(KUBELET_ROOT / "pod-resources" / "kubelet.sock"),
                                      timeout_s=5) as client:
            out: Dict[str, List[str]] = {}
            for devices in await client.allocatable():
                out.setdefault(devices.resource_name, []).extend(devices.device_ids)
            return {k: sorted(v) for k, v in out.items()}
    try:
        return asyncio.run(fetch())
    except Exception:  # the socket is away while the kubelet restarts
        return {}


def wait_allocatable(resource: str, ids: Sequence[str], host: Optional[Host] = None,
                     timeout: float = WAIT_S) -> None:
    want = sorted(ids)

    def probe() -> bool:
        if host is not None:
            host.alive()
        return kubelet_allocatable().get(resource) == want
    until(f"kubelet's allocatable {resource} = {want}", probe, timeout=timeout, every=0.1)


def leftovers() -> List[str]:
    """What a finished run must not leave: processes, mounts, the bridge, device nodes."""
    out = []
    for name in ("kubelet --config", "containerd --config", "containerd-shim-runc-v2"):
        pids = [p for p in _pids_of([name]) if p != os.getpid()]
        out += [f"process {p}: {name}" for p in pids]
    out += [f"mount {m}" for m in mounts_under(KUBELET_ROOT, WORK / "containerd", RUN)]
    if bridge_exists():
        out.append(f"bridge {BRIDGE}")
    for line in machine_lines():
        if line.startswith("c /dev/nvidia") and "nvswitch" not in line:
            path = line.split()[1]
            with contextlib.suppress(FileNotFoundError):
                if os.lstat(path).st_rdev == os.makedev(1, 3):
                    out.append(f"device node {path}")
    return out


@contextlib.contextmanager
def running(host: Host) -> Iterator[Host]:
    host.start()
    try:
        yield host
    finally:
        host.stop()


def gpu_resources(name: str = "nvidia.com/gpu", api: str = "device-plugin",
                  extra: str = "", addresses: Optional[Sequence[str]] = None) -> str:
    selectors = 'vendor = "0x10de"\nkernel_driver = "nvidia"\n'
    if addresses:
        selectors += f"pci_address = {json.dumps(list(addresses))}\n"
    api_line = 'api = "dra"\n' if api == "dra" else ""
    return (f'[[resource]]\nname = "{name}"\ndriver = "gpu"\n{api_line}{extra}'
            f"[resource.selectors]\n{selectors}\n")

