"""KubeClient against the API-server stand-in over real HTTP (the real server with
KUBEBUILDER_ASSETS), and its configuration from kubeconfig files and the in-cluster account."""

from __future__ import annotations

import ast
import base64
import inspect
import json
import os
import shutil
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

from host.dra.kube import KubeClient, KubeConfigError, KubeError, in_cluster_access
from host.sim.apiserver import SHARED_HELPERS, ApiServerStandIn, RealApiServer, kube_api

__all__ = ["kube_api"]

DRIVER = "gpu.nvidia.com.device-plugin-host.io"


def a_slice(name="node-a-gpu-0", node="node-a", devices=None, generation=1):
    return {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
        "metadata": {"name": name},
        "spec": {"driver": DRIVER, "nodeName": node,
                 "pool": {"name": f"{node}/nvidia.com/gpu", "generation": generation,
                          "resourceSliceCount": 1},
                 "devices": devices if devices is not None else [
                     {"name": "gpu0", "attributes": {"model": {"string": "A100"}}}]},
    }


def test_slice_create_list_update_delete(kube_api, run):
    async def scenario():
        client = KubeClient.from_settings(kube_api.kubeconfig_path)
        try:
            created = await client.create_resource_slice(a_slice())
            assert created["metadata"]["resourceVersion"]
            other = a_slice(name="node-b-gpu-0", node="node-b")
            await client.create_resource_slice(other)
            mine = await client.list_resource_slices(DRIVER, "node-a")
            assert [s["metadata"]["name"] for s in mine] == ["node-a-gpu-0"]
            created["spec"]["pool"]["generation"] = 2
            updated = await client.update_resource_slice(created)
            assert updated["metadata"]["resourceVersion"] != created["metadata"]["resourceVersion"]
            # The old resourceVersion is stale now: 409 Conflict, as etcd's compare-and-swap.
            with pytest.raises(KubeError) as err:
                await client.update_resource_slice(created)
            assert err.value.status == 409 and err.value.reason == "Conflict"
            with pytest.raises(KubeError) as err:
                await client.delete_resource_slice("node-a-gpu-0",
                                                   created["metadata"]["resourceVersion"])
            assert err.value.status == 409
            await client.delete_resource_slice("node-a-gpu-0",
                                               updated["metadata"]["resourceVersion"])
            with pytest.raises(KubeError) as err:
                await client.delete_resource_slice("node-a-gpu-0")
            assert err.value.status == 404 and err.value.reason == "NotFound"
            with pytest.raises(KubeError) as err:
                await client.update_resource_slice(created)
            assert err.value.status == 404
            await client.delete_resource_slice("node-b-gpu-0")
        finally:
            await client.close()

    run(scenario())


@pytest.mark.parametrize("mutate, field", [
    (lambda s: s["spec"]["devices"][0].update(name="GPU_0"), "spec.devices[0].name"),
    (lambda s: s["spec"]["pool"].update(resourceSliceCount=0), "spec.pool.resourceSliceCount"),
    (lambda s: s["spec"]["devices"][0]["attributes"].update(
        {"bad-key": {"string": "x"}}), "spec.devices[0].attributes"),
    (lambda s: s["spec"]["devices"][0]["attributes"].update(
        {"model": {"string": "x", "int": 1}}), "spec.devices[0].attributes[model]"),
    (lambda s: s["spec"]["devices"][0]["attributes"].update(
        {"fw": {"version": "1.2"}}), "spec.devices[0].attributes[fw].version"),
    (lambda s: s["spec"]["devices"][0]["attributes"].update(
        {"model": {"string": "m" * 65}}), "spec.devices[0].attributes[model].string"),
    (lambda s: s["spec"].update(devices=[{"name": f"d{i}"} for i in range(129)]),
     "spec.devices"),
    (lambda s: s["spec"].update(devices=[{"name": "d"}, {"name": "d"}]), "spec.devices[1]"),
    (lambda s: s["spec"].pop("nodeName"), "spec"),
    (lambda s: s["spec"]["pool"].update(name="node-a/Bad"), "spec.pool.name"),
    (lambda s: s["spec"].update(driver="x" * 64), "spec.driver"),
])
def test_invalid_slices_get_422_with_upstream_status(kube_api, run, mutate, field):
    obj = a_slice()
    mutate(obj)

    async def scenario():
        client = KubeClient.from_settings(kube_api.kubeconfig_path)
        try:
            with pytest.raises(KubeError) as err:
                await client.create_resource_slice(obj)
            return err.value
        finally:
            await client.close()

    error = run(scenario())
    assert error.status == 422 and error.reason == "Invalid"
    assert 'ResourceSlice.resource.k8s.io "node-a-gpu-0" is invalid' in error.message
    assert field in [c.get("field") for c in error.causes]


def test_node_and_claim_get(kube_api, run):
    node = kube_api.add_node("node-a")
    kube_api.put_resource_claim({
        "metadata": {"name": "claim-1", "namespace": "default"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
            "deviceClassName": "gpu.example.com"}}]}}})

    async def scenario():
        client = KubeClient.from_settings(kube_api.kubeconfig_path)
        try:
            got = await client.get_node("node-a")
            claim = await client.get_resource_claim("default", "claim-1")
            with pytest.raises(KubeError) as err:
                await client.get_node("node-x")
            assert err.value.status == 404
            with pytest.raises(KubeError) as err:
                await client.get_resource_claim("default", "nope")
            assert err.value.status == 404
            return got, claim
        finally:
            await client.close()

    got, claim = run(scenario())
    assert got["metadata"]["uid"] == node["metadata"]["uid"]
    assert claim["metadata"]["name"] == "claim-1"


def test_a_deleted_claim_is_gone_and_deleting_it_again_is_no_error(kube_api, run):
    kube_api.put_resource_claim({
        "metadata": {"name": "claim-1", "namespace": "default"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
            "deviceClassName": "gpu.example.com"}}]}}})
    kube_api.delete_resource_claim("default", "claim-1")
    kube_api.delete_resource_claim("default", "claim-1")

    async def scenario():
        client = KubeClient.from_settings(kube_api.kubeconfig_path)
        try:
            with pytest.raises(KubeError) as err:
                await client.get_resource_claim("default", "claim-1")
            return err.value.status
        finally:
            await client.close()

    assert run(scenario()) == 404


def test_each_test_gets_an_empty_api_server(run):
    """The real server is shared by the tests of a process: what one test left (a Node, a
    slice, claims in two namespaces) is gone for the next."""
    from host.sim.apiserver import api_server_under_test

    first = api_server_under_test()
    api = next(first)
    api.add_node("node-a")
    api.put_resource_slice(a_slice())
    for namespace in ("default", "kube-public"):
        api.put_resource_claim({
            "metadata": {"name": "claim-1", "namespace": namespace},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                "deviceClassName": "gpu.example.com"}}]}}})
    assert len(api.resource_slices()) == 1
    first.close()
    second = api_server_under_test()
    api = next(second)

    async def statuses():
        client = KubeClient.from_settings(api.kubeconfig_path)
        out = []
        try:
            for read in (lambda: client.get_node("node-a"),
                         lambda: client.get_resource_claim("default", "claim-1"),
                         lambda: client.get_resource_claim("kube-public", "claim-1")):
                with pytest.raises(KubeError) as err:
                    await read()
                out.append(err.value.status)
            return out
        finally:
            await client.close()

    try:
        assert api.resource_slices() == []
        assert run(statuses()) == [404, 404, 404]
    finally:
        second.close()


def _kube_api_attributes() -> set:
    """Every ``kube_api.NAME`` the test modules use."""
    names = set()
    for path in Path(__file__).resolve().parents[1].rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id == "kube_api"):
                names.add(node.attr)
    return names


def test_the_real_server_and_the_stand_in_offer_the_same_helpers(tmp_path, monkeypatch):
    """A helper only the stand-in has passes on the stand-in and breaks the suite against
    the real server (KUBEBUILDER_ASSETS, as CI runs it): every helper a test calls on
    ``kube_api`` is shared, and both classes take the same parameters for it."""
    used = _kube_api_attributes()
    assert {"add_node", "devices", "delete_resource_claim"} <= used  # the scan sees them
    assert used <= set(SHARED_HELPERS), sorted(used - set(SHARED_HELPERS))
    standin = ApiServerStandIn()
    real = RealApiServer(str(tmp_path))  # not started: no binaries needed
    try:
        for name in SHARED_HELPERS:
            mine, theirs = getattr(standin, name), getattr(real, name)
            if callable(mine):
                assert inspect.signature(mine) == inspect.signature(theirs), name
            else:
                assert type(mine) is type(theirs), name
    finally:
        standin.close()
        real.close()


def test_outage_refuses_and_recovers_on_the_same_port(run):
    with ApiServerStandIn() as api:
        api.add_node("node-a")

        async def scenario():
            client = KubeClient.from_settings(api.kubeconfig_path, timeout_s=2)
            try:
                await client.get_node("node-a")  # a pooled keep-alive connection now exists
                api.stop()
                with pytest.raises(KubeError) as err:
                    await client.get_node("node-a")
                assert err.value.status == 0
                api.start()
                assert (await client.get_node("node-a"))["metadata"]["name"] == "node-a"
            finally:
                await client.close()

        run(scenario())


def test_injected_failures_carry_a_status(run):
    with ApiServerStandIn() as api:
        api.fail_next(500, count=2, verbs={"list"})

        async def scenario():
            client = KubeClient.from_settings(api.kubeconfig_path)
            try:
                for _ in range(2):
                    with pytest.raises(KubeError) as err:
                        await client.list_resource_slices(DRIVER, "n")
                    assert err.value.status == 500 and err.value.reason == "InternalError"
                assert await client.list_resource_slices(DRIVER, "n") == []
            finally:
                await client.close()

        run(scenario())
        assert api.requests["list"] == 3


def test_unsupported_field_selector_is_a_400():
    import http.client

    with ApiServerStandIn() as api:
        conn = http.client.HTTPConnection(api.host, api.port, timeout=5)
        conn.request("GET", "/apis/resource.k8s.io/v1/resourceslices?fieldSelector=spec.pool=x",
                     headers={"Authorization": f"Bearer {api.TOKEN}"})
        response = conn.getresponse()
        body = json.loads(response.read())
        conn.close()
    assert response.status == 400
    assert "field label not supported" in body["message"]


def test_taints_are_dropped_while_the_gate_is_off(run):
    tainted = a_slice(devices=[{"name": "gpu0", "taints": [
        {"key": "device-plugin-host.io/unhealthy", "value": "xid-79", "effect": "NoSchedule"}]}])
    for gate, kept in ((False, False), (True, True)):
        with ApiServerStandIn(device_taints=gate) as api:
            async def scenario(api=api):
                client = KubeClient.from_settings(api.kubeconfig_path)
                try:
                    return await client.create_resource_slice(tainted)
                finally:
                    await client.close()

            stored = run(scenario())
            assert ("taints" in stored["spec"]["devices"][0]) is kept


# -- configuration --------------------------------------------------------------------------


class _Recorder(BaseHTTPRequestHandler):
    seen: list = []

    def do_GET(self):
        self.seen.append(self.headers.get("Authorization"))
        auth = self.headers.get("Authorization") or ""
        token = auth[len("Bearer "):] if auth.startswith("Bearer ") else ""
        ok = token == self.server.valid_token  # type: ignore[attr-defined]
        body = json.dumps({"kind": "Node", "metadata": {"name": "n"}} if ok else
                          {"kind": "Status", "reason": "Unauthorized", "code": 401}).encode()
        self.send_response(200 if ok else 401)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_a_rotated_token_file_is_reread_after_a_401(tmp_path, run):
    server = HTTPServer(("127.0.0.1", 0), _Recorder)
    server.valid_token = "old"  # type: ignore[attr-defined]
    _Recorder.seen = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    token = tmp_path / "token"
    token.write_text("old\n")
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        f"clusters:\n- name: k\n  cluster:\n    server: http://127.0.0.1:{server.server_port}\n"
        "contexts:\n- name: c\n  context:\n    cluster: k\n    user: u\n"
        "users:\n- name: u\n  user:\n    tokenFile: token\n")
    try:
        async def scenario():
            client = KubeClient.from_settings(str(kubeconfig))
            try:
                await client.get_node("n")
                token.write_text("new\n")  # the kubelet rotates the projected token
                server.valid_token = "new"  # type: ignore[attr-defined]
                await client.get_node("n")
            finally:
                await client.close()

        run(scenario())
    finally:
        server.shutdown()
        server.server_close()
    assert _Recorder.seen == ["Bearer old", "Bearer old", "Bearer new"]


def test_kubeconfig_errors_are_one_line(tmp_path):
    with pytest.raises(KubeConfigError, match="No such file"):
        KubeClient.from_settings(str(tmp_path / "missing"))
    bad = tmp_path / "bad"
    bad.write_text("current-context: x\ncontexts: []\n")
    with pytest.raises(KubeConfigError, match="context 'x' not found"):
        KubeClient.from_settings(str(bad))
    ftp = tmp_path / "ftp"
    ftp.write_text("current-context: c\ncontexts: [{name: c, context: {cluster: k}}]\n"
                   "clusters: [{name: k, cluster: {server: 'ftp://x'}}]\n")
    with pytest.raises(KubeConfigError, match="not an http"):
        KubeClient.from_settings(str(ftp))
    plugin = tmp_path / "exec"
    plugin.write_text("current-context: c\ncontexts: [{name: c, context: {cluster: k, user: u}}]\n"
                      "clusters: [{name: k, cluster: {server: 'https://x'}}]\n"
                      "users: [{name: u, user: {exec: {command: aws}}}]\n")
    with pytest.raises(KubeConfigError, match="exec credential plugin"):
        KubeClient.from_settings(str(plugin))


def test_kubeconfig_with_inline_ca_and_client_certificate(tmp_path):
    """certificate-authority-data and client-*-data load through files that vanish at once."""
    import subprocess

    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl CLI to make a certificate")
    key, cert = tmp_path / "k.pem", tmp_path / "c.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout",
                    str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=test"],
                   check=True, capture_output=True)
    b64 = {p: base64.b64encode(p.read_bytes()).decode() for p in (key, cert)}
    config = tmp_path / "kubeconfig"
    config.write_text(json.dumps({
        "current-context": "c",
        "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}],
        "clusters": [{"name": "k", "cluster": {"server": "https://127.0.0.1:1",
                                               "certificate-authority-data": b64[cert]}}],
        "users": [{"name": "u", "user": {"client-certificate-data": b64[cert],
                                         "client-key-data": b64[key]}}]}))
    before = set(os.listdir("/tmp"))
    client = KubeClient.from_settings(str(config))
    assert client.server == "https://127.0.0.1:1"
    assert not [n for n in set(os.listdir("/tmp")) - before if n.startswith("dph-kube-")]


def test_in_cluster_configuration(tmp_path):
    with pytest.raises(KubeConfigError, match="KUBERNETES_SERVICE_HOST"):
        in_cluster_access(env={}, sa_dir=str(tmp_path))
    env = {"KUBERNETES_SERVICE_HOST": "fd00::1", "KUBERNETES_SERVICE_PORT": "443"}
    with pytest.raises(KubeConfigError, match="no service account token"):
        in_cluster_access(env=env, sa_dir=str(tmp_path))
    (tmp_path / "token").write_text("t")
    access = in_cluster_access(env=env, sa_dir=str(tmp_path))
    assert access.server == "https://[fd00::1]:443"
    assert access.token_file == str(tmp_path / "token")


needs_openssl = pytest.mark.skipif(shutil.which("openssl") is None,
                                   reason="needs the openssl CLI for a serving certificate")


@needs_openssl
def test_in_cluster_over_tls_with_a_rotated_token(tmp_path, run):
    """The DaemonSet's path end to end: service env, the mounted token and CA, HTTPS; the
    kubelet rotates the token file and the server stops taking the old one."""
    with ApiServerStandIn(tls=True) as api:
        api.add_node("node-a")
        sa = tmp_path / "serviceaccount"
        api.write_service_account(str(sa), token="first")
        api.tokens = {"first"}
        env = {"KUBERNETES_SERVICE_HOST": api.host, "KUBERNETES_SERVICE_PORT": str(api.port)}

        async def scenario():
            client = KubeClient(in_cluster_access(env=env, sa_dir=str(sa)))
            try:
                await client.get_node("node-a")
                (sa / "token").write_text("second")
                api.tokens = {"second"}
                await client.get_node("node-a")  # 401, re-read, retried
                api.tokens = {"third"}  # a token the file does not hold: the 401 stays
                with pytest.raises(KubeError) as err:
                    await client.get_node("node-a")
                assert err.value.status == 401
            finally:
                await client.close()

        run(scenario())
        assert api.requests["get"] == 5


@needs_openssl
def test_a_server_certificate_from_another_ca_is_refused(tmp_path, run):
    with ApiServerStandIn(tls=True) as api, ApiServerStandIn(tls=True) as other:
        sa = tmp_path / "sa"
        other.write_service_account(str(sa))  # the other server's CA
        env = {"KUBERNETES_SERVICE_HOST": api.host, "KUBERNETES_SERVICE_PORT": str(api.port)}

        async def scenario():
            client = KubeClient(in_cluster_access(env=env, sa_dir=str(sa)))
            try:
                with pytest.raises(KubeError) as err:
                    await client.get_node("node-a")
                return err.value
            finally:
                await client.close()

        error = run(scenario())
        assert error.status == 0 and "CERTIFICATE_VERIFY_FAILED" in error.message
        assert api.requests["get"] == 0


@needs_openssl
def test_kubeconfig_with_a_certificate_authority_file(run):
    with ApiServerStandIn(tls=True) as api:
        api.add_node("node-a")

        async def scenario():
            client = KubeClient.from_settings(api.kubeconfig_path)
            try:
                return await client.get_node("node-a")
            finally:
                await client.close()

        assert run(scenario())["metadata"]["name"] == "node-a"


def test_kubebuilder_assets_must_hold_both_binaries(tmp_path, monkeypatch):
    from host.sim.apiserver import kubebuilder_assets

    monkeypatch.setenv("KUBEBUILDER_ASSETS", str(tmp_path))
    assert kubebuilder_assets() is None
    for name in ("kube-apiserver", "etcd"):
        path = tmp_path / name
        path.write_text("#!/bin/sh\n")
        path.chmod(0o755)
    assert kubebuilder_assets() == str(tmp_path)
    monkeypatch.delenv("KUBEBUILDER_ASSETS")
    assert kubebuilder_assets() is None


def test_the_stand_ins_watch_history_is_no_object_graph_and_still_replays():
    """The watch history keeps every event serialized: a deep copy of each event's object
    made every full garbage collection walk the whole history, a pause that grew with each
    write (over 100 ms after a few thousand writes) and landed in whatever a benchmark timed.
    A watch from an old resourceVersion still gets every event after it."""
    import gc

    devices = [{"name": f"gpu{i}", "attributes": {"model": {"string": "A100"},
                                                   "index": {"int": i}}} for i in range(32)]
    with ApiServerStandIn() as api:
        first = api.put_resource_slice(a_slice(devices=devices))
        gc.collect()
        before = len(gc.get_objects())
        for generation in range(2, 202):
            api.put_resource_slice(a_slice(devices=devices, generation=generation))
        gc.collect()
        grown = len(gc.get_objects()) - before
        assert grown < 200 * 5, f"{grown} objects tracked for 200 events"

        async def replay():
            client = KubeClient.from_settings(api.kubeconfig_path)
            try:
                seen = []
                watch = client.watch_node_slices("node-a", first["metadata"]["resourceVersion"])
                async for event in watch:
                    seen.append((event["type"], event["object"]["spec"]["pool"]["generation"],
                                 event["object"]["spec"]["devices"][31]["attributes"]))
                    if len(seen) == 200:
                        break
                return seen
            finally:
                await client.close()

        import asyncio
        seen = asyncio.run(replay())
        assert [g for _, g, _ in seen] == list(range(2, 202))
        assert {t for t, _, _ in seen} == {"MODIFIED"}
        assert seen[-1][2] == {"model": {"string": "A100"}, "index": {"int": 31}}
