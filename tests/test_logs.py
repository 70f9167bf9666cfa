"""Structured logs: JSON lines carry resource, driver and device fields."""

from __future__ import annotations

import io
import json
import logging

import pytest

from host.logs import setup_logging


@pytest.fixture
def json_log():
    stream = io.StringIO()
    setup_logging("debug", "json", stream)
    yield stream
    setup_logging("warning", "plain")


def _lines(stream):
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_json_lines_name_resource_driver_and_device(json_log):
    log = logging.getLogger("host.service")
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
        logging.getLogger("host.registration").info("resource %s: registered", "a.b/c")
    finally:
        setup_logging("warning", "plain")
    line = stream.getvalue().strip()
    assert line.endswith("host.registration: resource a.b/c: registered")
