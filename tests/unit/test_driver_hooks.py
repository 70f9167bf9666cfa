"""The allocate and pre-start step both APIs share (host/core/isolation.py)."""

from __future__ import annotations

import asyncio

import pytest

from host.core.driver import Driver
from host.core.isolation import (
    PRE_START_TIMEOUT_S,
    DriverCallError,
    DriverCalls,
    driver_allocate,
    driver_pre_start,
)
from host.core.model import ContainerAllocation, Device, ResourceConfig


class _Odd(Driver):
    name = "odd"

    def allocate(self, resource, devices, merged):
        return {"envs": {}}

    def pre_start(self, resource, devices):
        raise RuntimeError("card busy")


def test_a_wrong_answer_and_a_failing_pre_start_are_driver_call_errors():
    calls = DriverCalls()
    resource = ResourceConfig("example.com/x", "odd")
    devices = [Device(id="a")]

    async def main():
        with pytest.raises(DriverCallError) as wrong:
            await driver_allocate(calls, _Odd(), resource, devices, ContainerAllocation(), 1.0)
        assert str(wrong.value) == "driver 'odd' allocate returned dict, not ContainerAllocation"
        assert not wrong.value.timed_out
        with pytest.raises(DriverCallError) as failed:
            await driver_pre_start(calls, _Odd(), resource, devices)
        assert str(failed.value) == "driver 'odd' pre_start: RuntimeError: card busy"

    try:
        asyncio.run(main())
    finally:
        calls.shutdown()
    assert PRE_START_TIMEOUT_S < 30  # inside the kubelet's PreStartContainer deadline
