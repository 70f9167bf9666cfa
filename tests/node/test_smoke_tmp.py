import nodelib

def test_dp_smoke(node, pods, tmp_path):
    with nodelib.running(nodelib.Host(node, tmp_path / "h", nodelib.gpu_resources())) as host:
        nodelib.wait_allocatable("nvidia.com/gpu", nodelib.GPU_ADDRESSES, host)
        pods.create("p", [nodelib.container("a", {"nvidia.com/gpu": 1}), nodelib.container("b", {"nvidia.com/gpu": 2})])
        pods.running("p")
        for c in "ab":
            s = pods.seen("p", c)
            print(c, s.gpus, s.visible)
