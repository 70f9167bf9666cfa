"""Our .proto files against the wire facts, and the committed modules against the .proto files."""

from __future__ import annotations

from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2
from google.protobuf.descriptor import FieldDescriptor as F

from host.kubelet.protocol import api, podresources
from host.kubelet.protocol.generate import HERE, generate


def test_committed_modules_match_a_fresh_generation():
    pytest.importorskip("grpc_tools", reason="grpcio-tools (the generator) is a Python 3.10+ "
                        "test extra; the committed modules are checked where it installs")
    for name, text in generate().items():
        committed = (HERE / name).read_text(encoding="utf-8")
        assert committed == text, f"{name} is stale: run python -m host.kubelet.protocol.generate"


def test_device_plugin_wire_contract():
    file = api.DESCRIPTOR
    proto = descriptor_pb2.FileDescriptorProto.FromString(file.serialized_pb)
    assert file.package == "v1beta1" and proto.syntax == "proto3"
    plugin = file.services_by_name["DevicePlugin"]
    methods = {m.name: m for m in plugin.methods}
    assert list(methods) == ["GetDevicePluginOptions", "ListAndWatch", "GetPreferredAllocation",
                             "Allocate", "PreStartContainer"]
    assert methods["ListAndWatch"].output_type.name == "ListAndWatchResponse"
    registration = file.services_by_name["Registration"]
    assert [m.name for m in registration.methods] == ["Register"]
    numa = api.NUMANode.DESCRIPTOR.fields_by_name["ID"]
    assert numa.number == 1 and numa.type == F.TYPE_INT64
    size = api.ContainerPreferredAllocationRequest.DESCRIPTOR.fields_by_name["allocation_size"]
    assert size.type == F.TYPE_INT32 and size.number == 3
    assert api.ContainerAllocateRequest.DESCRIPTOR.fields_by_name["devices_ids"].number == 1
    response = api.ContainerAllocateResponse.DESCRIPTOR.fields_by_name
    assert {n: f.number for n, f in response.items()} == {
        "envs": 1, "mounts": 2, "devices": 3, "annotations": 4, "cdi_devices": 5}
    assert response["envs"].message_type.GetOptions().map_entry
    device = api.Device.DESCRIPTOR.fields_by_name
    assert {n: f.number for n, f in device.items()} == {"ID": 1, "health": 2, "topology": 3}
    register = api.RegisterRequest.DESCRIPTOR.fields_by_name
    assert {n: f.number for n, f in register.items()} == {
        "version": 1, "endpoint": 2, "resource_name": 3, "options": 4}


def test_streaming_flag_is_on_the_wire():
    from host.kubelet.protocol import api_grpc

    source = Path(api_grpc.__file__).read_text()
    assert "unary_stream_rpc_method_handler(\n                    servicer.ListAndWatch" in source


def test_pod_resources_wire_contract():
    file = podresources.DESCRIPTOR
    assert file.package == "v1"
    lister = file.services_by_name["PodResourcesLister"]
    assert [m.name for m in lister.methods] == ["List", "GetAllocatableResources", "Get"]
    memory = podresources.ContainerMemory.DESCRIPTOR.fields_by_name["size"]
    assert memory.type == F.TYPE_UINT64
    share = podresources.ClaimResource.DESCRIPTOR.fields_by_name["share_id"]
    assert share.number == 5 and share.has_presence
    cpu = podresources.AllocatableResourcesResponse.DESCRIPTOR.fields_by_name["cpu_ids"]
    assert cpu.type == F.TYPE_INT64 and cpu.is_packed
