"""The API client is imported only for DRA: the device-plugin-only host's start-up time and
memory are benchmarked, and httpx + the client cost ~20 ms and ~4 MiB."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_device_plugin_path_imports_no_api_client():
    code = ("import sys, host.app, host.cli, host.config, host.kubelet.service; "
            "bad = sorted(m for m in sys.modules if m == 'httpx' or m.startswith('httpx.') "
            "or m in ('host.dra.kube', 'host.dra.publisher', 'yaml')); print(bad)")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=60, check=True)
    assert done.stdout.strip() == "[]", done.stdout
