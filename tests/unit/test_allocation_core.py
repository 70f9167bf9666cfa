"""The allocation core without gRPC, threads or an event loop: ``merge``, ``numa_compact`` and
``replica_preferred`` are pure functions over Device records (host/core/allocation.py), so their
rules are pinned here directly; tests/test_preferred.py and tests/test_host.py show the same
answers reaching the kubelet simulator over real sockets."""

from __future__ import annotations

import itertools
from typing import List, Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from host.core.allocation import merge, natural_key, numa_compact, replica_preferred
from host.core.model import Device, DeviceNode, Mount


def gpu(i: int, numa: Sequence[int] = (0,), **extra) -> Device:
    return Device(id=f"gpu{i}", numa_nodes=tuple(numa), **extra)


# -- merge ---------------------------------------------------------------------------------
def test_merge_keeps_request_order_and_dedupes_shared_nodes_by_container_path():
    ctl = DeviceNode("/dev/nvidiactl")
    a = gpu(0, device_nodes=(DeviceNode("/dev/nvidia0"), ctl), env={"V": "0"},
            mounts=(Mount("/usr/lib/a", "/lib/a"),), cdi_devices=("n/gpu=0",))
    b = gpu(1, device_nodes=(DeviceNode("/dev/nvidia1"), ctl), env={"V": "1"},
            mounts=(Mount("/usr/lib/a", "/lib/a"),), cdi_devices=("n/gpu=1", "n/gpu=0"))
    out = merge([b, a])
    assert [n.host_path for n in out.device_nodes] == ["/dev/nvidia1", "/dev/nvidiactl",
                                                       "/dev/nvidia0"]
    assert out.envs == {"V": "1,0"}
    assert [m.container_path for m in out.mounts] == ["/lib/a"]
    assert out.cdi_devices == ("n/gpu=1", "n/gpu=0")


def test_merge_joins_repeated_env_and_annotation_values_once():
    a = gpu(0, env={"PCIDEVICE_X": "0000:3b:00.0", "SAME": "s"}, annotations={"k": "v"})
    b = gpu(1, env={"PCIDEVICE_X": "0000:3b:00.1", "SAME": "s"}, annotations={"k": "v"})
    out = merge([a, b])
    assert out.envs == {"PCIDEVICE_X": "0000:3b:00.0,0000:3b:00.1", "SAME": "s"}
    assert out.annotations == {"k": "v"}


def test_merge_of_nothing_is_an_empty_allocation():
    out = merge([])
    assert out.envs == {} and out.device_nodes == () and out.mounts == ()
    assert out.annotations == {} and out.cdi_devices == ()


def test_natural_key_orders_gpu2_before_gpu10_and_pci_addresses_as_text():
    assert sorted(["gpu10", "gpu2", "gpu1"], key=natural_key) == ["gpu1", "gpu2", "gpu10"]
    addresses = ["0000:3b:00.0", "0000:18:00.0", "0000:af:00.0"]
    assert sorted(addresses, key=natural_key) == sorted(addresses)


# -- numa_compact --------------------------------------------------------------------------
def test_numa_compact_fits_a_request_on_one_node_when_one_can_hold_it():
    devices = [gpu(i, (i // 4,)) for i in range(8)]
    assert numa_compact(devices, [], 3) == ["gpu0", "gpu1", "gpu2"]


def test_numa_compact_best_fit_leaves_the_larger_pool_whole():
    # node 0 has 4 free, node 1 has 2 free: a request for 2 goes to node 1.
    devices = [gpu(i, (0,)) for i in range(4)] + [gpu(i, (1,)) for i in (4, 5)]
    assert numa_compact(devices, [], 2) == ["gpu4", "gpu5"]


def test_numa_compact_keeps_must_include_and_uses_their_node_first():
    devices = [gpu(i, (i // 4,)) for i in range(8)]
    picked = numa_compact(devices, [devices[5]], 3)
    assert picked[0] == "gpu5" and set(picked) <= {f"gpu{i}" for i in range(4, 8)}


def test_numa_compact_spans_the_fewest_nodes_when_none_holds_the_request():
    devices = [gpu(i, (i // 2,)) for i in range(8)]  # 4 nodes of 2
    picked = numa_compact(devices, [], 4)
    assert len({int(p[3:]) // 2 for p in picked}) == 2


def test_numa_compact_uses_devices_without_topology_only_when_needed():
    devices = [gpu(0, ()), gpu(1, (0,)), gpu(2, (0,))]
    assert numa_compact(devices, [], 2) == ["gpu1", "gpu2"]
    assert sorted(numa_compact(devices, [], 3)) == ["gpu0", "gpu1", "gpu2"]


def test_numa_compact_returns_fewer_only_when_fewer_exist():
    devices = [gpu(0, (0,)), gpu(1, ())]
    assert sorted(numa_compact(devices, [], 5)) == ["gpu0", "gpu1"]
    assert numa_compact(devices, [devices[0]], 1) == ["gpu0"]


def _nodes_spanned(devices: Sequence[Device], ids: Sequence[str]) -> int:
    by_id = {d.id: d for d in devices}
    return len({n for i in ids for n in by_id[i].numa_nodes})


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=12), st.data())
def test_numa_compact_properties(numa_of, data):
    devices = [gpu(i, (n,)) for i, n in enumerate(numa_of)]
    must = data.draw(st.lists(st.sampled_from(devices), unique_by=lambda d: d.id, max_size=2))
    size = data.draw(st.integers(len(must), len(devices)))
    picked = numa_compact(devices, must, size)
    assert len(picked) == size and len(set(picked)) == size
    assert [d.id for d in must] == picked[: len(must)]
    # No other choice holding the must-include devices spans fewer NUMA nodes.
    rest = [d.id for d in devices if d not in must]
    best = min(_nodes_spanned(devices, [d.id for d in must] + list(c))
               for c in itertools.combinations(rest, size - len(must)))
    assert _nodes_spanned(devices, picked) == best


# -- replica_preferred ---------------------------------------------------------------------
def replicas(device: str, ks: Sequence[int]) -> List[Device]:
    return [Device(id=f"{device}::{k}", attributes={"replica_of": device}) for k in ks]


def test_pack_fills_the_most_used_device_first():
    # gpu0 has 1 of 4 replicas free (3 in use), gpu1 has all 4 free.
    available = replicas("gpu0", [3]) + replicas("gpu1", [0, 1, 2, 3])
    assert replica_preferred(available, [], 2, 4, "pack") == ["gpu0::3", "gpu1::0"]


def test_spread_takes_one_replica_of_each_least_used_device_in_turn():
    available = replicas("gpu0", [3]) + replicas("gpu1", [0, 1, 2, 3]) + \
        replicas("gpu2", [0, 1, 2, 3])
    assert replica_preferred(available, [], 3, 4, "spread") == ["gpu1::0", "gpu2::0",
                                                                "gpu0::3"]


def test_pack_keeps_must_include_and_fills_their_device_next():
    available = replicas("gpu0", [0, 1, 2, 3]) + replicas("gpu1", [0, 1, 2, 3])
    must = [available[5]]  # gpu1::1
    assert replica_preferred(available, must, 3, 4, "pack") == ["gpu1::1", "gpu1::0",
                                                                "gpu1::2"]


def test_replica_preference_never_picks_more_than_asked_or_exists():
    available = replicas("gpu0", [0, 1])
    for policy in ("pack", "spread"):
        assert replica_preferred(available, [], 1, 2, policy) == ["gpu0::0"]
        assert replica_preferred(available, [], 5, 2, policy) == ["gpu0::0", "gpu0::1"]
