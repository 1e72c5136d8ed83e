"""Run by tests/test_cuda_ipc_gpu.py: a producer process with a CUDA IPC ring on ``cuda:0``.

    python tests/scripts/cuda_ring_producer.py tcp://127.0.0.1:PORT STEPS ROWS

Connects a DEALER to ADDRESS, sends the ring's offer (HELLO meta ``cuda_ipc``), then for
``seq`` in 1..STEPS fills ``policy`` (float32 [ROWS, 15]) with ``seq + arange`` on the GPU,
writes it into the ring and sends the step (OBSERVATION meta ``cuda_ipc``); it writes the
next one only after an ACTION for this one, as an env worker does. Exits 0 after a BYE.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import zmq

from gateway.cuda_ipc import CudaRing
from gateway.protocol import Message, MsgType, recv, send


def expected(seq: int, rows: int) -> torch.Tensor:
    return torch.arange(rows * 15, dtype=torch.float32).reshape(rows, 15) + seq


def main() -> int:
    address, steps, rows = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    ring = CudaRing.create({"policy": ("float32", (rows, 15))}, "cuda:0")
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(address)
    send(sock, Message(MsgType.HELLO, meta={"cuda_ipc": ring.offer()}))
    base = expected(0, rows).cuda()
    for seq in range(1, steps + 1):
        # Computed on the GPU, as a simulator's observations are: only the ring copy follows.
        step = ring.write(seq, {"policy": base + seq})
        send(sock, Message(MsgType.OBSERVATION, seq=seq, meta={"cuda_ipc": step}))
        if not sock.poll(30_000) or recv(sock).type is not MsgType.ACTION:
            return 1
    if not sock.poll(30_000) or recv(sock).type is not MsgType.BYE:
        return 1
    ring.close()
    sock.close()
    ctx.term()
    return 0


if __name__ == "__main__":
    sys.exit(main())
