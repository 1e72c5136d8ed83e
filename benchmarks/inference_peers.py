"""Processes of the inference benchmark (:mod:`benchmarks.inference`): clients and peer servers.

Roles, each ``python -m benchmarks.inference_peers ROLE ...``:

- ``client``: ``--clients`` closed-loop clients (``--kind loopgate|websocket|grpc``),
  each with its own connection, in one load-generating process (as wrk or ghz do, so
  that on a small machine the figures are the servers' and not the scheduling of many
  client processes): websocket and gRPC clients in one asyncio event loop, their
  libraries' native way, and loopgate's DEALER sockets polled by one thread, ZeroMQ's
  (``zmq.asyncio`` costs more per message than the server does). Each sends batches of
  ``--batch`` reach observations and waits for each answer. It connects, then waits
  for the ``--go`` file (written once the clients are ready), warms up, and keeps the
  requests that start and finish inside the window the file names (``time.monotonic``
  is one clock for every process on the machine). It writes ``t_send`` (s) and
  ``latency_us`` of those requests and the row count to ``--out``.
- ``websocket-server``: the same ONNX model behind a minimal websocket + msgpack server
  in the style of OpenPI's policy server: an asyncio ``websockets`` server that unpacks
  each message (msgpack with numpy arrays as ``__ndarray__`` maps), runs the policy on
  it in the event loop and sends the packed action back. One request at a time.
- ``grpc-server``: the same model behind a gRPC unary method (raw bytes, the same
  msgpack payload) served by a thread pool.

These peers are benchmark baselines only; nothing in the product imports them::

    python -m benchmarks.inference_peers websocket-server --port 8765 --model m.onnx --ready r
    python -m benchmarks.inference_peers client --kind websocket --connect ws://127.0.0.1:8765 \\
        --batch 1 --go go.json --out c0.npz
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

log = logging.getLogger(__name__)


# --------------------------------------------------------- OpenPI-style msgpack


def _pack_array(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        return {"__ndarray__": True, "data": obj.tobytes(), "dtype": obj.dtype.str, "shape": obj.shape}
    return obj


def _unpack_array(obj: dict[Any, Any]) -> Any:
    if "__ndarray__" in obj:
        return np.ndarray(buffer=obj["data"], dtype=np.dtype(obj["dtype"]), shape=obj["shape"])
    return obj


def packb(obj: Any) -> bytes:
    return msgpack.packb(obj, default=_pack_array)  # type: ignore[no-any-return]


def unpackb(data: bytes) -> Any:
    return msgpack.unpackb(data, object_hook=_unpack_array)


class OnnxPolicy:
    """The benchmark model in onnxruntime (one intra-op thread, like the servers)."""

    def __init__(self, path: str, threads: int) -> None:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        self.session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
        self.action_shape = tuple(self.session.get_outputs()[0].shape[1:])

    def infer(self, obs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        n = len(next(iter(obs.values())))
        feeds = {f"obs/{k}": v for k, v in obs.items()}
        feeds["eps"] = np.zeros((n, *self.action_shape), np.float32)
        return {"action": self.session.run(["action"], feeds)[0]}


def run_websocket_server(args: argparse.Namespace) -> int:
    import asyncio

    from websockets.asyncio.server import serve

    policy = OnnxPolicy(args.model, args.threads)

    async def handler(websocket: Any) -> None:
        await websocket.send(packb({"model": args.model}))  # metadata first, as OpenPI does
        async for message in websocket:
            await websocket.send(packb(policy.infer(unpackb(message))))

    async def main() -> None:
        async with serve(handler, "127.0.0.1", args.port, compression=None, max_size=None):
            Path(args.ready).write_text("ready")
            await asyncio.Future()

    asyncio.run(main())
    return 0


def run_grpc_server(args: argparse.Namespace) -> int:
    from concurrent import futures

    import grpc

    policy = OnnxPolicy(args.model, args.threads)

    def infer(request: bytes, context: Any) -> bytes:
        return packb(policy.infer(unpackb(request)))

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=args.workers))
    handler = grpc.unary_unary_rpc_method_handler(infer)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("loopgate.Policy", {"Infer": handler}),)
    )
    server.add_insecure_port(f"127.0.0.1:{args.port}")
    server.start()
    Path(args.ready).write_text("ready")
    server.wait_for_termination()
    return 0


# ------------------------------------------------------------------- clients


def reach_obs(batch: int, seed: int) -> dict[str, np.ndarray]:
    from gateway.factory import experiment_spec

    spec = experiment_spec("mujoco_reach", {})
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal((batch, *a.shape)).astype(a.dtype) for k, a in spec.observation.items()}


async def _websocket_caller(address: str, obs: dict[str, np.ndarray]) -> Any:
    from websockets.asyncio.client import connect

    ws = await connect(address, compression=None, max_size=None, open_timeout=30)
    unpackb(await asyncio.wait_for(ws.recv(), 30))  # metadata

    async def call() -> None:
        await ws.send(packb(obs))
        unpackb(await asyncio.wait_for(ws.recv(), 30))["action"]

    return call


async def _grpc_caller(address: str, obs: dict[str, np.ndarray]) -> Any:
    import grpc

    channel = grpc.aio.insecure_channel(address)  # one connection per client, like the others
    await asyncio.wait_for(channel.channel_ready(), 30)
    method = channel.unary_unary("/loopgate.Policy/Infer")

    async def call() -> None:
        unpackb(await method(packb(obs), timeout=30))["action"]

    return call


CALLERS = {"websocket": _websocket_caller, "grpc": _grpc_caller}
"""asyncio clients; ``loopgate`` has its own loop (:func:`_run_loopgate_clients`)."""


async def _closed_loop(call: Any, window: dict[str, float], sent: list[float], latency: list[float]) -> None:
    start, stop = float(window["start"]), float(window["stop"])
    while True:
        t0 = time.monotonic()
        if t0 >= stop:
            return
        await call()
        t1 = time.monotonic()
        if t0 >= start and t1 <= stop:
            sent.append(t0)
            latency.append((t1 - t0) * 1e6)


def _window(args: argparse.Namespace) -> dict[str, float] | None:
    """Say the clients are ready, then wait for the go file; None if it never comes."""
    Path(args.out + ".ready").write_text("ready")
    go = Path(args.go)
    give_up = time.monotonic() + 120
    while not go.exists():
        if time.monotonic() > give_up:
            log.error("no go file %s within 120 s", go)
            return None
        time.sleep(0.005)
    window: dict[str, float] = json.loads(go.read_text())
    return window


def _save(args: argparse.Namespace, sent: list[float], latency: list[float]) -> int:
    np.savez(args.out, t_send=np.asarray(sent), latency_us=np.asarray(latency), rows=len(sent) * args.batch)
    return 0


async def _run_clients(args: argparse.Namespace) -> int:
    calls = []
    for i in range(args.clients):
        call = await CALLERS[args.kind](args.connect, reach_obs(args.batch, args.seed + i))
        await call()  # connected and served once
        calls.append(call)
    window = _window(args)  # blocking: nothing else runs on this loop yet
    if window is None:
        return 1
    sent: list[float] = []
    latency: list[float] = []
    await asyncio.gather(*(_closed_loop(call, window, sent, latency) for call in calls))
    return _save(args, sent, latency)


def _run_loopgate_clients(args: argparse.Namespace) -> int:
    """The loopgate clients as ZeroMQ is used without an event loop: one DEALER per client,
    all polled by one thread. Each request is encoded and each answer decoded in full,
    as the other kinds pack and unpack theirs."""
    import zmq

    from gateway.protocol import Message, MsgType, decode, encode, pack

    ctx = zmq.Context.instance()
    socks, obs = [], []
    for i in range(args.clients):
        sock = ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.connect(args.connect)
        socks.append(sock)
        obs.append(pack("obs", reach_obs(args.batch, args.seed + i)))
    index = {sock: i for i, sock in enumerate(socks)}
    seq = [0] * len(socks)
    started = [0.0] * len(socks)

    def call(i: int) -> None:
        seq[i] += 1
        msg = Message(MsgType.INFER, seq=seq[i], meta={"deadline_ms": 30_000.0}, arrays=obs[i])
        started[i] = time.monotonic()
        socks[i].send_multipart(encode(msg), copy=False)

    def answer(sock: Any) -> None:
        reply = decode(sock.recv_multipart(copy=False))
        if reply.type is not MsgType.ACTION:
            raise RuntimeError(f"server answered {reply.meta}")

    poller = zmq.Poller()
    for sock in socks:
        poller.register(sock, zmq.POLLIN)
    for i, sock in enumerate(socks):  # connected and served once
        call(i)
        if not sock.poll(30_000):
            raise TimeoutError("no answer from the server within 30 s")
        answer(sock)
    window = _window(args)
    if window is None:
        return 1
    start, stop = float(window["start"]), float(window["stop"])
    sent: list[float] = []
    latency: list[float] = []
    for i in range(len(socks)):
        call(i)
    waiting = len(socks)
    while waiting:
        events = poller.poll(30_000)
        if not events:
            raise TimeoutError("no answer from the server within 30 s")
        for sock, _ in events:
            answer(sock)
            i, t1 = index[sock], time.monotonic()
            if started[i] >= start and t1 <= stop:
                sent.append(started[i])
                latency.append((t1 - started[i]) * 1e6)
            if t1 < stop:
                call(i)
            else:
                waiting -= 1
    for sock in socks:
        sock.close()
    return _save(args, sent, latency)


def run_client(args: argparse.Namespace) -> int:
    if args.kind == "loopgate":
        return _run_loopgate_clients(args)
    return asyncio.run(_run_clients(args))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.inference_peers",
        description="Clients and baseline servers of the inference benchmark (started by `loopgate bench`).",
        epilog="example: python -m benchmarks.inference_peers grpc-server --port 50051 --model m.onnx --ready r",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--log-level", default="WARNING")
    sub = p.add_subparsers(dest="role", required=True)
    for role in ("websocket-server", "grpc-server"):
        s = sub.add_parser(role, help=f"the {role.split('-')[0]} baseline serving the ONNX model")
        s.add_argument("--port", type=int, required=True)
        s.add_argument("--model", required=True, help=".onnx file")
        s.add_argument("--ready", required=True, help="file written once serving")
        s.add_argument("--threads", type=int, default=1, help="onnxruntime intra-op threads")
        s.add_argument("--workers", type=int, default=16, help="gRPC handler threads")
    c = sub.add_parser("client", help="closed-loop clients (one connection each) in one event loop")
    c.add_argument("--kind", choices=sorted([*CALLERS, "loopgate"]), required=True)
    c.add_argument("--connect", required=True)
    c.add_argument("--batch", type=int, required=True)
    c.add_argument("--clients", type=int, default=1, help="concurrent clients, each with its own connection")
    c.add_argument("--go", required=True, help="file with the measuring window, written by the suite")
    c.add_argument("--out", required=True, help=".npz for the measured requests")
    c.add_argument("--seed", type=int, default=0)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    roles = {"websocket-server": run_websocket_server, "grpc-server": run_grpc_server, "client": run_client}
    return roles[args.role](args)


if __name__ == "__main__":
    sys.exit(main())
