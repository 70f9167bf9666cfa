"""The bare baselines: the least each measured path can cost with grpc.aio on this machine.

Each floor does only what the measured path cannot avoid (a unary round trip, a stream push of
the same bytes, a Register with its dial-back, a process that only imports, 64 servers that only
listen) through the same client style as the measurement, so a ratio near 1 means the host adds
nothing and a ratio above it is the host's own cost.

Run as a module for the floors that need their own process::

    python -m benchmarks.floors echo --socket PATH      # unary echo server until SIGTERM
    python -m benchmarks.floors servers --count 64 --dir D   # 64 idle servers until SIGTERM
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import time
from typing import AsyncIterator, List, Optional

import grpc

from host.kubelet.protocol import KUBELET_SOCKET, VERSION, api, api_grpc

ECHO_METHOD = "/bench.Echo/Echo"
# Answers every call with the bytes last given to SET_REPLY_METHOD: a bare handler returning a
# response of the same size as the host's (the Allocate floor).
REPLY_METHOD = "/bench.Echo/Reply"
SET_REPLY_METHOD = "/bench.Echo/SetReply"
PUSH_METHOD = "/bench.Push/Watch"
# What the kubelet simulator dials plugins with, so floor and measurement share a client style.
CLIENT_OPTIONS = [
    ("grpc.max_receive_message_length", 4 * 1024 * 1024),
    ("grpc.default_authority", "localhost"),
]


def _identity(data: bytes) -> bytes:
    return data


# -- unary echo (floor of Allocate / GetPreferredAllocation) ----------------------------------
def echo_handler() -> grpc.GenericRpcHandler:
    reply = [b""]

    async def echo(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return request

    async def answer(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return reply[0]

    async def set_reply(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        reply[0] = request
        return b""

    return grpc.method_handlers_generic_handler("bench.Echo", {
        "Echo": grpc.unary_unary_rpc_method_handler(
            echo, request_deserializer=_identity, response_serializer=_identity),
        "Reply": grpc.unary_unary_rpc_method_handler(
            answer, request_deserializer=_identity, response_serializer=_identity),
        "SetReply": grpc.unary_unary_rpc_method_handler(
            set_reply, request_deserializer=_identity, response_serializer=_identity),
    })


async def start_server(socket_path: str, handler: grpc.GenericRpcHandler) -> grpc.aio.Server:
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    if server.add_insecure_port(f"unix:{socket_path}") == 0:
        raise OSError(f"could not bind {socket_path}")
    await server.start()
    return server


# -- server-stream push (floor of ListAndWatch) -----------------------------------------------
class PushServer:
    """Streams each payload put in ``queue`` to its one watcher, as ListAndWatch would."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[bytes] = asyncio.Queue()

    def handler(self) -> grpc.GenericRpcHandler:
        async def watch(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
            while True:
                yield await self.queue.get()

        return grpc.method_handlers_generic_handler("bench.Push", {
            "Watch": grpc.unary_stream_rpc_method_handler(
                watch, request_deserializer=_identity, response_serializer=_identity),
        })


class _Receiver:
    """The floor's client: reads the stream, wakes whoever waits for the next message."""

    def __init__(self, call: grpc.aio.UnaryStreamCall) -> None:
        self.call = call
        self.received = 0
        self._waiter: Optional[asyncio.Future] = None
        self.task = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        async for _message in self.call:
            self.received += 1
            if self._waiter is not None and not self._waiter.done():
                self._waiter.set_result(None)

    async def next_after(self, seen: int) -> None:
        while self.received <= seen:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter

    async def close(self) -> None:
        self.call.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


class PushFloor:
    """A bare server-stream push to a client that only parses what it receives: the least a
    ListAndWatch message of the same bytes costs here. ``async with PushFloor(dir) as f``."""

    def __init__(self, directory: str) -> None:
        self.path = os.path.join(directory, "push.sock")
        self.push = PushServer()

    async def __aenter__(self) -> PushFloor:
        self.server = await start_server(self.path, self.push.handler())
        self.channel = grpc.aio.insecure_channel(f"unix:{self.path}", options=CLIENT_OPTIONS)
        self.receiver = _Receiver(self.channel.unary_stream(
            PUSH_METHOD, request_serializer=_identity,
            response_deserializer=api.ListAndWatchResponse.FromString)(b""))
        return self

    async def time_push_ms(self, payload: bytes) -> float:
        seen = self.receiver.received
        started = time.perf_counter()
        self.push.queue.put_nowait(payload)
        await asyncio.wait_for(self.receiver.next_after(seen), 30)
        return (time.perf_counter() - started) * 1000

    async def __aexit__(self, *exc: object) -> None:
        await self.receiver.close()
        await self.channel.close()
        await self.server.stop(None)


# -- minimal plugin (floor of re-registration) ------------------------------------------------
class MinimalPlugin:
    """One hand-written device plugin: a DevicePlugin server with options and ListAndWatch (one
    fixed snapshot), and a Register call. No inventory, no inotify, no reconcile loop."""

    def __init__(self, plugin_dir: str, resource: str, index: int, payload: bytes) -> None:
        self.plugin_dir = plugin_dir
        self.resource = resource
        self.index = index
        self.payload = payload
        self.generation = 0
        self.server: Optional[grpc.aio.Server] = None
        self._options = api.DevicePluginOptions(get_preferred_allocation_available=True)
        self._options_bytes = self._options.SerializeToString()

    def _handler(self) -> grpc.GenericRpcHandler:
        async def options(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            return self._options_bytes

        async def list_and_watch(request: bytes,
                                 context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
            yield self.payload
            await asyncio.get_running_loop().create_future()  # until cancelled

        return grpc.method_handlers_generic_handler("v1beta1.DevicePlugin", {
            "GetDevicePluginOptions": grpc.unary_unary_rpc_method_handler(
                options, request_deserializer=_identity, response_serializer=_identity),
            "ListAndWatch": grpc.unary_stream_rpc_method_handler(
                list_and_watch, request_deserializer=_identity, response_serializer=_identity),
        })

    async def register(self, channel: grpc.aio.Channel) -> None:
        """Serve anew (the kubelet wiped our socket) and register on ``channel``."""
        await self.stop()
        self.generation += 1
        name = f"min-{self.index}-{self.generation}.sock"
        self.server = await start_server(os.path.join(self.plugin_dir, name), self._handler())
        await api_grpc.RegistrationStub(channel).Register(api.RegisterRequest(
            version=VERSION, endpoint=name, resource_name=self.resource, options=self._options,
        ), timeout=10)

    async def stop(self) -> None:
        server, self.server = self.server, None
        if server is not None:
            await server.stop(None)


def kubelet_channel(plugin_dir: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(f"unix://{os.path.join(plugin_dir, KUBELET_SOCKET)}",
                                     options=[("grpc.enable_http_proxy", 0)])


# -- processes -------------------------------------------------------------------------------
async def _serve_until_signalled(servers: List[grpc.aio.Server]) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    print("ready", flush=True)
    await stop.wait()
    await asyncio.gather(*(server.stop(None) for server in servers))


async def _echo_main(socket_path: str) -> None:
    server = await start_server(socket_path, echo_handler())
    await _serve_until_signalled([server])


async def _servers_main(count: int, directory: str) -> None:
    servers = [await start_server(os.path.join(directory, f"bare-{i}.sock"), echo_handler())
               for i in range(count)]
    await _serve_until_signalled(servers)


async def _plugins_main(names: List[str], directory: str, devices: int) -> None:
    """What any Python device plugin process pays to serve and register ``names``: one
    MinimalPlugin each (a server, options, one fixed snapshot of ``devices`` Healthy devices)
    and its Register, all at once on one channel to the kubelet in ``directory``."""
    payload = api.ListAndWatchResponse(devices=[
        api.Device(ID=f"gpu{i}", health="Healthy") for i in range(devices)]).SerializeToString()
    plugins = [MinimalPlugin(directory, name, i, payload) for i, name in enumerate(names)]
    channel = kubelet_channel(directory)
    await asyncio.gather(*(plugin.register(channel) for plugin in plugins))
    servers = [plugin.server for plugin in plugins if plugin.server is not None]
    try:
        await _serve_until_signalled(servers)
    finally:
        await channel.close()


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.floors")
    sub = parser.add_subparsers(dest="command", required=True)
    echo = sub.add_parser("echo", help="a unary echo server on one unix socket")
    echo.add_argument("--socket", required=True)
    servers = sub.add_parser("servers", help="N idle grpc.aio servers on unix sockets")
    servers.add_argument("--count", type=int, default=64)
    servers.add_argument("--dir", required=True)
    plugins = sub.add_parser("plugins", help="N minimal device plugins, each registered with "
                                             "the kubelet at DIR/kubelet.sock")
    plugins.add_argument("--dir", required=True)
    plugins.add_argument("--devices", type=int, default=4)
    plugins.add_argument("names", nargs="+", help="the resource names")
    args = parser.parse_args(argv)
    if args.command == "echo":
        asyncio.run(_echo_main(args.socket))
    elif args.command == "plugins":
        asyncio.run(_plugins_main(args.names, args.dir, args.devices))
    else:
        asyncio.run(_servers_main(args.count, args.dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
