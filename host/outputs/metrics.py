"""The metrics output: each served resource's device and health counts on /metrics."""

from __future__ import annotations

from typing import Sequence

from host.core.model import Device, ResourceConfig
from host.metrics import HostMetrics
from host.outputs import Output


class MetricsOutput(Output):
    def __init__(self, metrics: HostMetrics) -> None:
        self.metrics = metrics

    def sync(self, resource: ResourceConfig, devices: Sequence[Device]) -> None:
        self.metrics.set_devices(resource.name, devices)

    async def forget(self, resource: ResourceConfig) -> None:
        self.metrics.remove_resource(resource.name)
