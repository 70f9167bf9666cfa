"""Our DRA and plugin-registration protos against upstream's wire contract.

Upstream: kubernetes/kubelet pkg/apis/dra/v1/api.proto, dra/v1beta1/api.proto (package
k8s.io.kubelet.pkg.apis.dra.<v>, service DRAPlugin) and pluginregistration/v1/api.proto
(package "pluginregistration", service Registration).
"""

from __future__ import annotations

import pytest
from google.protobuf import descriptor_pb2

from host.dra.protocol import dra_v1, dra_v1beta1
from host.dra.protocol.generate import HERE, generate
from host.kubelet.protocol import pluginregistration_v1_pb2 as registration


def test_committed_modules_match_a_fresh_generation():
    pytest.importorskip("grpc_tools", reason="grpcio-tools is a Python 3.10+ test extra")
    for name, text in generate().items():
        committed = (HERE / name).read_text(encoding="utf-8")
        assert committed == text, f"{name} is stale: run python -m host.dra.protocol.generate"


@pytest.mark.parametrize("module,version", [(dra_v1, "v1"), (dra_v1beta1, "v1beta1")])
def test_dra_wire_contract(module, version):
    file = module.DESCRIPTOR
    assert file.package == f"k8s.io.kubelet.pkg.apis.dra.{version}"
    service = file.services_by_name["DRAPlugin"]
    assert service.full_name == f"k8s.io.kubelet.pkg.apis.dra.{version}.DRAPlugin"
    assert [m.name for m in service.methods] == ["NodePrepareResources",
                                                 "NodeUnprepareResources"]
    numbers = {f.name: f.number for f in module.Device.DESCRIPTOR.fields}
    shared = {"share_id": 5} if version == "v1" else {}  # v1 only: optional string share_id
    assert numbers == {"request_names": 1, "pool_name": 2, "device_name": 3,
                       "cdi_device_ids": 4, **shared}
    if shared:
        assert module.Device.DESCRIPTOR.fields_by_name["share_id"].has_presence
    assert {f.name: f.number for f in module.Claim.DESCRIPTOR.fields} == {
        "namespace": 1, "uid": 2, "name": 3}
    entry = module.NodePrepareResourceResponse.DESCRIPTOR.fields_by_name
    assert entry["devices"].number == 1 and entry["error"].number == 2
    claims = module.NodePrepareResourcesResponse.DESCRIPTOR.fields_by_name["claims"]
    assert claims.number == 1 and claims.message_type.GetOptions().map_entry
    proto = descriptor_pb2.FileDescriptorProto.FromString(file.serialized_pb)
    assert proto.syntax == "proto3"


def test_registration_wire_contract():
    file = registration.DESCRIPTOR
    assert file.package == "pluginregistration"
    service = file.services_by_name["Registration"]
    assert service.full_name == "pluginregistration.Registration"
    assert [m.name for m in service.methods] == ["GetInfo", "NotifyRegistrationStatus"]
    assert {f.name: f.number for f in registration.PluginInfo.DESCRIPTOR.fields} == {
        "type": 1, "name": 2, "endpoint": 3, "supported_versions": 4}
    assert {f.name: f.number for f in registration.RegistrationStatus.DESCRIPTOR.fields} == {
        "plugin_registered": 1, "error": 2}


@pytest.mark.parametrize("version", ["v1alpha1", "v1"])
def test_dra_health_wire_contract(version):
    """kubernetes/kubelet pkg/apis/dra-health/v1alpha1 (as the 1.36 kubelet calls it) and
    dra-health/v1 (newer kubelets, package "v1"): the same messages and numbers."""
    from host.dra.protocol import dra_health as v1alpha1
    from host.dra.protocol import dra_health_v1 as v1

    dra_health = {"v1alpha1": v1alpha1, "v1": v1}[version]
    file = dra_health.DESCRIPTOR
    assert file.package == version
    service = file.services_by_name["DRAResourceHealth"]
    [method] = service.methods
    assert method.name == "NodeWatchResources" and method.server_streaming
    assert {f.name: f.number for f in dra_health.DeviceIdentifier.DESCRIPTOR.fields} == {
        "pool_name": 1, "device_name": 2}
    assert {f.name: f.number for f in dra_health.DeviceHealth.DESCRIPTOR.fields} == {
        "device": 1, "health": 2, "last_updated_time": 3, "health_check_timeout_seconds": 4,
        "message": 5}
    assert dict(dra_health.HealthStatus.items()) == {"UNKNOWN": 0, "HEALTHY": 1,
                                                     "UNHEALTHY": 2}
