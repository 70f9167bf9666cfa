"""Which client-channel setup re-reaches a restarted kubelet fastest?

Not a suite family: a one-off probe whose numbers are quoted in host/kubelet/registration.py.
Each trial: a kubelet-like Registration server on ``kubelet.sock``; a Register goes through;
a second Register is in flight (the handler is slow) when the server stops and its socket is
unlinked; the socket stays away for the outage; then a new server listens and the client,
with a fresh channel built per candidate, Registers until one succeeds. The figure is the time
from the new server listening to that success. Every trial uses its own directory, so no
subchannel state carries over between trials through the target name.

    python -m benchmarks.reconnect_probe --outages 0.5 2 10 --repeat 3
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from typing import Dict, List, Optional, Tuple

import grpc

from host.kubelet.protocol import VERSION, api, api_grpc

Options = List[Tuple[str, object]]


class _Slow(api_grpc.RegistrationServicer):
    def __init__(self, delay: float) -> None:
        self.delay = delay

    async def Register(self, request: api.RegisterRequest,
                       context: grpc.aio.ServicerContext) -> api.Empty:
        await asyncio.sleep(self.delay)
        return api.Empty()


async def _serve(path: str, delay: float) -> grpc.aio.Server:
    server = grpc.aio.server()
    api_grpc.add_RegistrationServicer_to_server(_Slow(delay), server)
    server.add_insecure_port("unix:" + path)
    await server.start()
    return server


def _request() -> api.RegisterRequest:
    return api.RegisterRequest(version=VERSION, endpoint="x.sock", resource_name="a.b/c")


BASE: Options = [("grpc.enable_http_proxy", 0)]
CANDIDATES: Dict[str, Tuple[Options, bool]] = {
    # name: (options of the fresh channel, wait until the channel is READY before Register)
    "global pool (before)": (BASE, False),
    "local subchannel pool": ([*BASE, ("grpc.use_local_subchannel_pool", 1)], False),
    "fresh channel, unique arg per identity": (BASE, False),  # the arg is added per trial
    "bounded backoff 50/100 ms": ([*BASE, ("grpc.initial_reconnect_backoff_ms", 50),
                                          ("grpc.min_reconnect_backoff_ms", 50),
                                          ("grpc.max_reconnect_backoff_ms", 100)], False),
    "dial waits for accept (wait_for_ready)": (BASE, True),
}


async def _trial(name: str, outage: float) -> float:
    options, ready_first = CANDIDATES[name]
    with tempfile.TemporaryDirectory(prefix="dph-probe-", dir="/tmp") as root:
        path = os.path.join(root, "kubelet.sock")
        target = "unix://" + path
        server = await _serve(path, delay=0.3)
        old = grpc.aio.insecure_channel(target, options=BASE)
        stub = api_grpc.RegistrationStub(old)
        await stub.Register(_request(), timeout=5)  # the first kubelet: fine
        in_flight = asyncio.ensure_future(stub.Register(_request(), timeout=5))
        await asyncio.sleep(0.05)
        await server.stop(None)  # kubelet stops: the in-flight Register fails, socket unlinked
        try:
            await in_flight
        except grpc.aio.AioRpcError:
            pass
        # A retry that reaches the old channel while the socket is away (the kubelet's socket
        # lingers, not accepting, while it stops; the host retries 50 ms later): connect fails
        # with ENOENT and the subchannel enters reconnect backoff, which it keeps growing
        # (pick_first stays in TRANSIENT_FAILURE and retries on its own) for the whole outage.
        # Without this call nothing reconnects and every candidate takes ~2 ms.
        try:
            await stub.Register(_request(), timeout=1)
        except grpc.aio.AioRpcError:
            pass
        await asyncio.sleep(outage)
        server = await _serve(path, delay=0.0)
        started = time.monotonic()
        opts = list(options)
        if name.startswith("fresh channel"):
            opts.append(("dph.kubelet_identity", f"{os.stat(path).st_ino}"))
        fresh = grpc.aio.insecure_channel(target, options=opts)
        fstub = api_grpc.RegistrationStub(fresh)
        try:
            while True:
                try:
                    await fstub.Register(_request(), timeout=15, wait_for_ready=ready_first)
                    break
                except grpc.aio.AioRpcError:
                    await asyncio.sleep(0.002)
            return (time.monotonic() - started) * 1000
        finally:
            await fresh.close()
            await old.close()
            await server.stop(None)


async def _main(outages: List[float], repeat: int, only: Optional[str]) -> None:
    names = [n for n in CANDIDATES if only is None or only in n]
    for outage in outages:
        for name in names:
            samples = [await _trial(name, outage) for _ in range(repeat)]
            print(f"outage {outage:>4} s  {name:42} median {statistics.median(samples):8.1f} ms"
                  f"  max {max(samples):8.1f} ms")


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--outages", type=float, nargs="+", default=[0.5, 2.0, 10.0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--only", default=None)
    args = parser.parse_args(argv)
    asyncio.run(_main(args.outages, args.repeat, args.only))


if __name__ == "__main__":
    main()
