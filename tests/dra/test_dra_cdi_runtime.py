"""The CDI injection stand-in follows the CDI library: spec-wide edits once per spec, env
replaced in place, device nodes and mounts replaced by path, unresolvable ids and same-name
conflicts fail."""

from __future__ import annotations

import json
import os

import pytest

from device_plugin_host_testing.cdi_runtime import CdiCache, CdiError


def _write(directory, name, spec):
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, name), "w") as stream:
        json.dump(spec, stream)


def test_injection_order_and_replacement(tmp_path):
    d = str(tmp_path)
    _write(d, "a.json", {"cdiVersion": "0.3.0", "kind": "x.com/g",
                         "containerEdits": {"env": ["COMMON=1", "V=spec"]},
                         "devices": [
                             {"name": "d0", "containerEdits": {
                                 "env": ["V=d0"], "deviceNodes": [{"path": "/dev/g0"}]}},
                             {"name": "d1", "containerEdits": {
                                 "env": ["V=d1"], "deviceNodes": [{"path": "/dev/g0"},
                                                                  {"path": "/dev/g1"}],
                                 "mounts": [{"hostPath": "/h/a/b", "containerPath": "/a/b"},
                                            {"hostPath": "/h/a", "containerPath": "/a"}]}}]})
    cache = CdiCache(d)
    c = cache.inject(["x.com/g=d1", "x.com/g=d0"])
    assert c.env == ["COMMON=1", "V=d0"]  # replaced in place, the spec's edits came first
    assert c.device_paths() == ["/dev/g0", "/dev/g1"]  # one node per path
    assert [m["containerPath"] for m in c.mounts] == ["/a", "/a/b"]
    with pytest.raises(CdiError, match=r"unresolvable CDI devices x\.com/g=nope"):
        cache.inject(["x.com/g=d0", "x.com/g=nope"])


def test_a_name_defined_twice_resolves_to_nothing_and_empty_devices_are_refused(tmp_path):
    d = str(tmp_path)
    dev = {"name": "d0", "containerEdits": {"env": ["A=1"]}}
    _write(d, "a.json", {"cdiVersion": "0.3.0", "kind": "x.com/g", "devices": [dev]})
    _write(d, "b.json", {"cdiVersion": "0.3.0", "kind": "x.com/g", "devices": [dev]})
    _write(d, "c.json", {"cdiVersion": "0.3.0", "kind": "x.com/g",
                         "devices": [{"name": "e", "containerEdits": {}}]})
    cache = CdiCache(d)
    assert "x.com/g=d0" not in cache.devices
    assert "empty containerEdits" in cache.errors[os.path.join(d, "c.json")]
