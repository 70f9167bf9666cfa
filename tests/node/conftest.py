"""The whole-node suite: one real node (nodelib.Node) for the session, brought up by the first
test that needs it and taken down by pid at the end, whatever happened. Every test here skips,
with the reason, without root, without ../shared/k8s/kubelet.xz or when setup-runtime cannot
install the container runtime. Only ``-m node`` collects this directory (tests/conftest.py)."""

from __future__ import annotations

from typing import Iterator

import nodelib
import pytest


def pytest_collection_modifyitems(items: list) -> None:
    for item in items:
        if "tests/node/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.node)
            item.add_marker(pytest.mark.timeout(300))


@pytest.fixture(scope="session")
def node() -> Iterator[nodelib.Node]:
    reason = nodelib.skip_reason()
    if reason:
        pytest.skip(reason)
    whole = nodelib.Node(nodelib.unpack_assets())
    try:
        whole.start()
        yield whole
    finally:
        whole.close()
