"""Structured logs: JSON lines carry resource, driver and device fields."""

from __future__ import annotations

import io
import json
import logging

import pytest

from host.cli.logs import setup_logging


@pytest.fixture
def json_log():
    stream = io.StringIO()
    setup_logging("debug", "json", stream)
    yield stream
    setup_logging("warning", "plain")


def _lines(stream):
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_json_lines_name_resource_driver_and_device(json_log):
    log = logging.getLogger("host.kubelet.service")
    log.warning("resource %s: Allocate refused: %s", "nvidia.com/gpu",
                "container_requests[0]: unknown device id 'x'")
    logging.getLogger("host.inventory").error("driver %r discover: boom; its resources (%s)",
                                              "gpu", "nvidia.com/gpu")
    logging.getLogger("host.inventory").warning("resource %s: device %s is gone from the host",
                                                "example.com/nic", "0000:3b:00.2")
    logging.getLogger("x").info("explicit", extra={"resource": "a.b/c", "device": "d1"})
    first, second, third, fourth = _lines(json_log)
    assert first["resource"] == "nvidia.com/gpu" and first["level"] == "warning"
    assert second["driver"] == "gpu" and second["resource"] == "nvidia.com/gpu"
    assert third["resource"] == "example.com/nic" and third["device"] == "0000:3b:00.2"
    assert fourth["resource"] == "a.b/c" and fourth["device"] == "d1"
    assert all(line["time"].endswith("Z") for line in (first, second, third, fourth))


def test_plain_format_is_one_readable_line():
    stream = io.StringIO()
    setup_logging("info", "plain", stream)
    try:
        logging.getLogger("host.kubelet.registration").info("resource %s: registered", "a.b/c")
    finally:
        setup_logging("warning", "plain")
    line = stream.getvalue().strip()
    assert line.endswith("host.kubelet.registration: resource a.b/c: registered")


@pytest.mark.parametrize("level", ["info", "debug"])
def test_api_requests_are_logged_only_at_debug(level, run):
    """httpx logs each request at INFO; the host shows them only with log_level = "debug"."""
    from host.dra.kube import KubeClient
    from host.sim.apiserver import ApiServerStandIn

    stream = io.StringIO()
    setup_logging(level, "plain", stream)
    try:
        with ApiServerStandIn() as api:
            api.add_node("node-a")

            async def read():
                client = KubeClient.from_settings(api.kubeconfig_path)
                try:
                    return await client.get_node("node-a")
                finally:
                    await client.close()

            assert run(read())["metadata"]["name"] == "node-a"
            logging.getLogger("host.dra").info("after the request")
    finally:
        setup_logging("warning", "plain")
    text = stream.getvalue()
    assert "after the request" in text  # the stream did get INFO lines
    requests = [line for line in text.splitlines() if "HTTP Request: GET" in line]
    assert len(requests) == (1 if level == "debug" else 0), text
