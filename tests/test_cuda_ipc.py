"""CUDA IPC handles (:mod:`gateway.cuda_ipc`, :mod:`gateway.cuda_handles`) on a CPU machine.

The handles' wire form, every check, the ring's slots and keep-alive, the consumer's
caches and the availability checks are the product's code. Where a test needs a GPU to
share memory it uses ``standin`` (:mod:`tests.cuda_standin`: CPU tensors and a table in
this process stand in for CUDA, which cannot run here); the tests with real CUDA are in
``tests/test_cuda_ipc_gpu.py``.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from typing import Any

import msgpack
import pytest
import torch

from gateway import cuda_ipc
from gateway.config import ConfigError, GatewayConfig
from gateway.cuda_handles import RingOffer, check_handle, same_device
from gateway.protocol import ErrorCode, Limits, ProtocolError
from gateway.shm import host_identity
from inference.config import InferenceConfig
from tests.conftest import REPO
from tests.cuda_standin import UUID

pytestmark = pytest.mark.unit

LAYOUT = {"policy": ("float32", (8, 15)), "image": ("uint8", (8, 4, 4, 3))}


def wire(value: Any) -> Any:
    """``value`` as the other end of a socket gets it (msgpack, as every meta travels)."""
    return msgpack.unpackb(msgpack.packb(value))


def observations(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "policy": torch.randn(8, 15, generator=g),
        "image": torch.randint(0, 256, (8, 4, 4, 3), dtype=torch.uint8, generator=g),
    }


@pytest.fixture
def ring(standin):
    made = cuda_ipc.CudaRing.create(LAYOUT, "cpu", slots=3)
    try:
        yield made
    finally:
        made.close()


def handle_for(ring: cuda_ipc.CudaRing, seq: int, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """What an inference server gets for observation ``seq``: worker -> gateway -> server."""
    offer = RingOffer.parse(wire(ring.offer()))
    step = ring.write(seq, tensors)
    assert step is not None
    return wire(offer.handle(wire(step)))


def test_observations_travel_as_handles_and_are_read_in_place_after_the_producers_event(ring, standin):
    reader = cuda_ipc.DeviceReader("cpu")
    for seq in range(1, 7):
        sent = observations(seq)
        handle = reader.check(handle_for(ring, seq, sent))
        got = reader.open(handle)
        assert set(got) == set(sent)
        for key, value in sent.items():
            assert torch.equal(got[key], value)
            # In place: the consumer's tensor is the producer's slot buffer, not a copy.
            assert got[key].data_ptr() == ring.buffers[seq % 3][key].data_ptr()
        assert handle.layout() == {k: (d, s) for k, (d, s) in LAYOUT.items()}
    events = [e for e, _ in ring.events]
    assert [e.recorded for e in events] == [2, 2, 2]  # after every copy, before the handle left
    assert [e.waited for e in events] == [2, 2, 2]  # and waited on before every read
    assert len(msgpack.packb(handle_for(ring, 7, observations(7)))) < 1024  # instead of ~2.5 KB of arrays


def test_slots_are_reused_in_turn_shared_and_opened_once_and_kept_for_the_rings_life(ring, standin):
    reader = cuda_ipc.DeviceReader("cpu")
    pointers = [{k: t.data_ptr() for k, t in slot.items()} for slot in ring.buffers]
    opened: dict[int, dict[str, torch.Tensor]] = {}
    for seq in range(1, 10):
        opened[seq] = reader.open(reader.check(handle_for(ring, seq, observations(seq))))
        assert [{k: t.data_ptr() for k, t in slot.items()} for slot in ring.buffers] == pointers
    assert standin.shared == 3 * len(LAYOUT)  # each slot's buffers shared once, at creation
    assert standin.opened == 3 * len(LAYOUT)  # and opened once by the consumer (cached)
    # A slot holds its observation until the ring comes round to it again (3 writes later).
    assert torch.equal(opened[9]["policy"], observations(9)["policy"])
    assert torch.equal(opened[8]["policy"], observations(8)["policy"])
    assert torch.equal(opened[6]["policy"], observations(9)["policy"])  # slot 0, overwritten by 9
    assert ring.bytes_shared == 9 * (8 * 15 * 4 + 8 * 48)
    assert reader.bytes_read == ring.bytes_shared


def test_the_consumers_cache_is_bounded(ring, standin):
    reader = cuda_ipc.DeviceReader("cpu", cache_size=2)
    for seq in range(1, 7):
        reader.open(reader.check(handle_for(ring, seq, observations(seq))))
    assert len(reader._storages) == 2 and standin.opened > 3 * len(LAYOUT)


def test_without_interprocess_events_the_producer_synchronises_and_sends_none(monkeypatch):
    from tests.cuda_standin import CpuStandIn

    ops = CpuStandIn(events=False)
    monkeypatch.setattr(cuda_ipc, "_OPS", ops)
    ring = cuda_ipc.CudaRing.create(LAYOUT, "cpu", slots=2)
    step = ring.write(1, observations(1))
    assert step == {"slot": 1, "event": None} and ops.syncs == 1
    reader = cuda_ipc.DeviceReader("cpu")
    handle = reader.check(wire(RingOffer.parse(wire(ring.offer())).handle(step)))
    assert handle.event is None
    assert torch.equal(reader.open(handle)["image"], observations(1)["image"])


def test_observations_that_do_not_fit_the_ring_go_without_a_handle_logged_once(ring, caplog):
    wrong = {**observations(1), "policy": torch.zeros(8, 14)}
    with caplog.at_level(logging.WARNING, logger="gateway.cuda_ipc"):
        assert ring.write(1, wrong) is None
        assert ring.write(2, wrong) is None
        assert ring.write(3, None) is None
    assert sum("does not fit the CUDA IPC ring" in r.message for r in caplog.records) == 1
    assert ring.write(4, observations(4)) is not None


BAD_HANDLES = [
    (lambda h: h.update(v=2), "version 2 is not 1"),
    (lambda h: h.update(uuid=7), "host and uuid must be strings"),
    (lambda h: h.update(event=b"x"), "event must be 64 bytes or nil"),
    (lambda h: h.update(arrays=[]), "arrays must be a non-empty list"),
    (lambda h: h["arrays"].append(list(h["arrays"][0])), "appears twice"),
    (lambda h: h["arrays"][0].__setitem__(1, "object"), "dtype 'object' is not allowed"),
    (lambda h: h["arrays"][0].__setitem__(2, [8, -15]), "bad shape"),
    (lambda h: h["arrays"][0].__setitem__(3, [15]), "bad shape"),
    (lambda h: h["arrays"][0].__setitem__(4, 1), "needs 484 bytes; its storage has 480"),
    (lambda h: h["arrays"][0].__setitem__(2, [9, 15]), "needs 540 bytes; its storage has 480"),
    (lambda h: h["arrays"][0][5].__setitem__(1, "text"), "memory handle must be 1..4096 bytes"),
    (lambda h: h["arrays"][0][5].__setitem__(2, 1 << 40), "storage size"),
    (lambda h: h["arrays"][0][5].__setitem__(4, b"/etc/passwd"), "not a torch ref-counter name"),
    (lambda h: h["arrays"][0][5].__setitem__(6, b"short"), "event must be 64 bytes"),
    (lambda h: h["arrays"][0][5].__setitem__(0, -1), "is not an index"),
    (lambda h: h["arrays"][0].pop(), r"must be \[key, dtype, shape, stride, offset, storage\]"),
]


@pytest.mark.parametrize(("change", "match"), BAD_HANDLES)
def test_a_bad_handle_is_refused_naming_the_problem_and_the_reader_goes_on(ring, change, match):
    reader = cuda_ipc.DeviceReader("cpu")
    handle = handle_for(ring, 1, observations(1))
    change(handle)
    with pytest.raises(ProtocolError, match=match) as caught:
        reader.check(handle)
    assert caught.value.code is ErrorCode.BAD_REQUEST and "CUDA IPC handle" in caught.value.message
    good = reader.open(reader.check(handle_for(ring, 2, observations(2))))
    assert torch.equal(good["policy"], observations(2)["policy"])


def test_a_handle_for_another_gpu_or_host_or_too_large_is_refused(ring):
    reader = cuda_ipc.DeviceReader("cpu")
    handle = handle_for(ring, 1, observations(1))
    with pytest.raises(ProtocolError, match=f"for GPU GPU-other; this server runs on {UUID}"):
        reader.check({**handle, "uuid": "GPU-other"})
    with pytest.raises(ProtocolError, match="from another host"):
        reader.check({**handle, "host": "elsewhere/boot"})
    with pytest.raises(ProtocolError, match=r"storage size 480 is not in 1..256 bytes"):
        check_handle(handle, Limits(max_frame_bytes=256))
    with pytest.raises(ProtocolError, match="864 bytes exceed max_message_bytes=800"):
        check_handle(handle, Limits(max_message_bytes=800))
    with pytest.raises(ProtocolError, match="must be a map"):
        check_handle([handle])


def test_a_handle_whose_producer_is_gone_is_refused_not_a_crash(ring, standin):
    handle = handle_for(ring, 1, observations(1))
    standin.storages.clear()  # the producer exited: the driver refuses its handles
    reader = cuda_ipc.DeviceReader("cpu")
    with pytest.raises(ProtocolError, match=r"of 'policy' cannot be opened \(its producer gone\?\)"):
        reader.open(reader.check(handle))
    standin.event_table.clear()
    with pytest.raises(ProtocolError, match="event cannot be opened"):
        reader._wait(handle["event"])


def test_a_bad_step_is_refused_and_a_bad_offer_declined_saying_why(ring):
    offer = RingOffer.parse(wire(ring.offer()))
    for step, match in [
        ({"slot": 3}, r"slot 3 is not in \[0, 3\)"),
        ({"slot": True}, "slot True"),
        ("x", "slot None"),
        ({"slot": 0, "event": "e"}, "event must be 64 bytes"),
    ]:
        with pytest.raises(ProtocolError, match=match):
            offer.handle(step)
    good = wire(ring.offer())
    for change, match in [
        ({"host": "elsewhere/boot"}, "another host"),
        ({"v": 9}, "v=1"),
        ({"slots": 2}, "as many as slots says"),
        ({"uuid": ""}, "uuid must be a string"),
    ]:
        with pytest.raises(ValueError, match=match):
            RingOffer.parse({**good, **change})
    odd = wire(ring.offer())
    odd["slot_arrays"][1][0][2] = [4, 15]
    with pytest.raises(ValueError, match="slot 1 holds"):
        RingOffer.parse(odd)


def test_a_server_takes_handles_only_for_its_own_host_and_gpu():
    handle = {"host": host_identity(), "uuid": "GPU-a"}
    assert same_device({"host": host_identity(), "uuid": "GPU-a", "device": 3}, handle)
    assert not same_device({"host": host_identity(), "uuid": "GPU-b"}, handle)
    assert not same_device({"host": "other/boot", "uuid": "GPU-a"}, handle)
    assert not same_device(None, handle)


def test_weights_staging_shares_each_buffer_once_and_the_consumer_copies_out(standin):
    staging = cuda_ipc.Staging("cpu")
    reader = cuda_ipc.DeviceReader("cpu")
    state = {"w": torch.randn(4, 3), "b": torch.randn(3)}
    for round_ in range(3):
        state = {k: v + round_ for k, v in state.items()}
        got = reader.copy_out(reader.check(wire(staging.handle(state))))
        for k, v in state.items():
            assert torch.equal(got[k], v)
            assert got[k].data_ptr() != staging.buffers[k][0].data_ptr()  # a copy: the server's own
    assert standin.shared == standin.opened == 2  # shared once, opened once
    staging.handle({"w": torch.randn(5, 3)})  # a new shape: a new buffer; a name gone: let go
    assert standin.shared == 3 and set(staging.buffers) == {"w"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the fallback of a machine without CUDA")
def test_without_cuda_nothing_is_offered_or_declared_and_it_says_why_once(caplog, monkeypatch):
    """The real CUDA calls on this CPU machine: torch sees no device. (The "once" is per
    process: what earlier tests in this process logged is forgotten first.)"""
    monkeypatch.setattr(cuda_ipc, "_logged", set())
    from sim_bridges.batched import TorchEnvBackend
    from sim_bridges.torch_reach import TorchReachConfig, TorchReachEnv

    assert "sees no CUDA device" in (cuda_ipc.why_unavailable() or "")
    backend = TorchEnvBackend(TorchReachEnv(TorchReachConfig(), num_envs=4), name="reach")
    assert backend.observation_device == "cpu"
    with caplog.at_level(logging.INFO, logger="gateway.cuda_ipc"):
        assert cuda_ipc.CudaRing.for_worker("on", "tcp://127.0.0.1:1", backend) is None
        assert cuda_ipc.CudaRing.for_worker("on", "tcp://127.0.0.1:1", backend) is None
        assert cuda_ipc.DeviceReader.for_device("auto", "cpu") is None
    assert cuda_ipc.CudaRing.for_worker("off", "tcp://127.0.0.1:1", backend) is None
    assert cuda_ipc.DeviceReader.for_device("off", "cuda:0") is None
    lines = [r.message for r in caplog.records if "sees no CUDA device" in r.message]
    assert len(lines) == 2 and "observations go by shared memory or frames" in lines[0]


@pytest.mark.parametrize(
    ("mode", "address", "wanted"),
    [
        ("auto", "tcp://127.0.0.1:5555", True),
        ("auto", "ipc:///tmp/run/workers.sock", True),
        ("auto", "tcp://10.1.2.3:5555", False),
        ("on", "tcp://10.1.2.3:5555", True),
        ("off", "tcp://127.0.0.1:5555", False),
    ],
)
def test_a_ring_is_offered_to_local_gateways_or_when_asked(mode, address, wanted):
    assert cuda_ipc.wanted(mode, address) is wanted


def test_the_mode_fields_are_validated_naming_the_field():
    with pytest.raises(ConfigError, match=r"gateway\.cuda_ipc must be auto, on or off, got 'yes'"):
        GatewayConfig(cuda_ipc="yes")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"inference\.cuda_ipc must be auto or off, got 'on'"):
        InferenceConfig(cuda_ipc="on")  # type: ignore[arg-type]
    assert GatewayConfig().cuda_ipc == "auto" and InferenceConfig().cuda_ipc == "auto"


def test_the_gateway_worker_and_handles_import_without_torch():
    code = (
        "import sys, gateway.cuda_ipc, gateway.cuda_handles, gateway.hub, gateway.worker, inference.client; "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the fallback of a machine without CUDA")
def test_the_gpu_bench_suite_skips_without_cuda_with_one_line_saying_why(caplog):
    from benchmarks import suites

    run, names = suites.load("gpu")
    assert {"weights.sync_s.100M.cuda_ipc", "weights.sync_s.100M.host", "obs.infer_us.n4096.cuda_ipc"} <= set(
        names
    )
    with caplog.at_level(logging.INFO):
        assert run(quick=True, repeats=1) == []
    (line,) = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert "skipping the GPU suite" in line.message and "sees no CUDA device" in line.message
