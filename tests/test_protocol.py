"""The wire protocol: round trips, and a clear typed error for every malformed input."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from gateway.protocol import (
    PROTOCOL_VERSION,
    ErrorCode,
    Limits,
    Message,
    MsgType,
    ProtocolError,
    RemoteError,
    decode,
    encode,
    error_message,
    raise_for_error,
    recv,
    recv_frames,
    recv_routed,
    send,
    send_frames,
)

pytestmark = pytest.mark.unit

DTYPES = [
    "bool",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "float32",
    "float64",
]
meta_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=10,
)
arrays = st.sampled_from(DTYPES).flatmap(
    lambda dt: hnp.arrays(np.dtype(dt), hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=5))
)


def header(**fields):
    base = {"v": PROTOCOL_VERSION, "t": int(MsgType.OBSERVATION), "s": 1, "m": {}, "a": []}
    base.update(fields)
    return msgpack.packb(base, use_bin_type=True)


@given(
    st.sampled_from(list(MsgType)),
    st.integers(0, 2**63 - 1),
    st.dictionaries(st.text(max_size=10), meta_values, max_size=5),
    st.dictionaries(st.text(min_size=1, max_size=12), arrays, max_size=5),
)
@settings(max_examples=200, deadline=None)
def test_any_message_round_trips_exactly(msg_type, seq, meta, arrs):
    msg = Message(msg_type, seq=seq, meta=meta, arrays=arrs)
    out = decode(encode(msg))
    assert out.type is msg_type and out.seq == seq and out.meta == meta
    assert set(out.arrays) == set(arrs)
    for key, arr in arrs.items():
        got = out.arrays[key]
        assert got.dtype == arr.dtype and got.shape == arr.shape
        np.testing.assert_array_equal(got, arr)


@given(st.lists(st.binary(max_size=64), min_size=0, max_size=6))
@settings(max_examples=300, deadline=None)
def test_random_bytes_only_ever_raise_protocol_error(frames):
    with contextlib.suppress(ProtocolError):
        decode(frames)


@given(st.binary(min_size=0, max_size=200), st.integers(0, 4))
@settings(max_examples=200, deadline=None)
def test_mutated_valid_header_only_ever_raises_protocol_error(noise, position):
    good = encode(Message(MsgType.ACTION, seq=3, arrays={"a": np.zeros((2, 3), np.float32)}))
    head = bytearray(good[0])
    head[position % len(head) : position % len(head) + len(noise)] = noise
    with contextlib.suppress(ProtocolError):
        decode([bytes(head), *good[1:]])


@contextlib.contextmanager
def tcp_pair(bound: int, connected: int) -> Iterator[tuple[zmq.Socket[Any], zmq.Socket[Any]]]:
    """A socket of type ``bound`` on a free loopback port and one of type ``connected`` dialled to it."""
    ctx = zmq.Context.instance()
    a, b = ctx.socket(bound), ctx.socket(connected)
    a.linger = b.linger = 0
    port = a.bind_to_random_port("tcp://127.0.0.1")
    b.connect(f"tcp://127.0.0.1:{port}")
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def test_frames_go_whole_through_a_router_and_back_in_order():
    """``send_frames``/``recv_frames`` (the codec's own multipart loops) over real TCP
    sockets: every frame in order, routing frames included, a received frame forwarded as
    it is, a large array without a copy; an empty socket under NOBLOCK raises ``Again``."""
    with tcp_pair(zmq.ROUTER, zmq.DEALER) as (router, dealer):
        big = np.arange(1 << 17, dtype=np.float64)
        parts = [b"", b"one", memoryview(b"two"), big.view(np.uint8), b"four"]
        send_frames(dealer, parts)
        assert router.poll(5000)
        got = recv_frames(router)
        peer = got[0].bytes
        assert [f.bytes for f in got[1:3]] == [b"", b"one"] and got[3].bytes == b"two"
        np.testing.assert_array_equal(np.frombuffer(got[4].buffer, np.float64), big)
        assert got[5].bytes == b"four" and not got[5].more and len(got) == 6
        send_frames(router, [peer, *got[1:]], zmq.NOBLOCK)  # forwarded Frames, as the server does
        assert dealer.poll(5000)
        back = recv_frames(dealer, zmq.NOBLOCK)
        assert [f.bytes for f in back] == [b"", b"one", b"two", big.tobytes(), b"four"]
        send(dealer, Message(MsgType.OBSERVATION, seq=3, arrays={"obs/x": big}))
        assert router.poll(5000)
        who, msg, err = recv_routed(router)
        assert who == peer and err is None and msg is not None and msg.seq == 3
        with pytest.raises(zmq.Again):
            recv_frames(dealer, zmq.NOBLOCK)
        with pytest.raises(ValueError, match="at least one frame"):
            send_frames(dealer, [])


def test_arrays_are_received_without_copies():
    with tcp_pair(zmq.PAIR, zmq.PAIR) as (a, b):
        big = np.arange(1 << 18, dtype=np.float32)
        send(a, Message(MsgType.OBSERVATION, arrays={"obs/x": big}))
        assert b.poll(5000)
        got = recv(b).arrays["obs/x"]
        np.testing.assert_array_equal(got, big)
        # A view of the received frame's buffer, not a private copy.
        base = got
        while isinstance(base, (np.ndarray, memoryview)):
            base = base.base if isinstance(base, np.ndarray) else base.obj
        assert isinstance(base, zmq.Frame)
        assert not got.flags.owndata


MALFORMED = {
    "empty message": ([], ErrorCode.TRUNCATED),
    "not msgpack": ([b"\xc1\xc1\xc1"], ErrorCode.BAD_HEADER),
    "header not a map": ([msgpack.packb([1, 2, 3])], ErrorCode.BAD_HEADER),
    "wrong version": ([header(v=99)], ErrorCode.BAD_VERSION),
    "missing version": ([msgpack.packb({"t": 5})], ErrorCode.BAD_VERSION),
    "unknown type": ([header(t=999)], ErrorCode.UNKNOWN_TYPE),
    "type not int": ([header(t="OBSERVATION")], ErrorCode.UNKNOWN_TYPE),
    "seq not int": ([header(s="x")], ErrorCode.BAD_HEADER),
    "meta not map": ([header(m=[1])], ErrorCode.BAD_HEADER),
    "array table not list": ([header(a={"x": 1})], ErrorCode.BAD_HEADER),
    "truncated multipart": ([header(a=[["x", "float32", [4]]])], ErrorCode.TRUNCATED),
    "extra frame": ([header(), b"1234"], ErrorCode.TRUNCATED),
    "bad array entry": ([header(a=[["x", "float32"]]), b""], ErrorCode.BAD_HEADER),
    "object dtype": ([header(a=[["x", "object", [1]]]), b"12345678"], ErrorCode.BAD_DTYPE),
    "unknown dtype": ([header(a=[["x", "complex128", [1]]]), b"0" * 16], ErrorCode.BAD_DTYPE),
    "big-endian dtype": ([header(a=[["x", ">f4", [1]]]), b"0000"], ErrorCode.BAD_DTYPE),
    "negative dim": ([header(a=[["x", "float32", [-1]]]), b""], ErrorCode.BAD_SHAPE),
    "float dim": ([header(a=[["x", "float32", [1.5]]]), b"0000"], ErrorCode.BAD_SHAPE),
    "too many dims": ([header(a=[["x", "uint8", [1] * 9]]), b"0"], ErrorCode.BAD_SHAPE),
    "length mismatch": ([header(a=[["x", "float32", [3]]]), b"0" * 8], ErrorCode.LENGTH_MISMATCH),
    "absurd shape": ([header(a=[["x", "float64", [2**40, 2**40]]]), b"0" * 8], ErrorCode.TOO_LARGE),
    "duplicate key": (
        [header(a=[["x", "uint8", [1]], ["x", "uint8", [1]]]), b"0", b"0"],
        ErrorCode.BAD_HEADER,
    ),
    "header key not a string": ([msgpack.packb({1: 1, "v": PROTOCOL_VERSION, "t": 5})], ErrorCode.BAD_HEADER),
    "meta key not a string": ([header(m={1: "x"})], ErrorCode.BAD_HEADER),
    "version as a bool": ([header(v=True)], ErrorCode.BAD_VERSION),
    "trailing bytes": ([header() + b"\x00"], ErrorCode.BAD_HEADER),
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_malformed_input_is_refused_with_its_code(name):
    frames, code = MALFORMED[name]
    with pytest.raises(ProtocolError) as info:
        decode(frames)
    assert info.value.code is code
    assert info.value.message  # a sentence a person can act on


def test_limits_refuse_oversize_frames_headers_and_messages():
    small = Limits(max_frames=3, max_header_bytes=512, max_frame_bytes=1024, max_message_bytes=1500)
    big = Message(MsgType.OBSERVATION, arrays={"x": np.zeros(2048, np.uint8)})
    with pytest.raises(ProtocolError, match="over the frame limit") as info:
        decode(encode(big), small)
    assert info.value.code is ErrorCode.TOO_LARGE
    many = Message(MsgType.OBSERVATION, arrays={str(i): np.zeros(1, np.uint8) for i in range(5)})
    with pytest.raises(ProtocolError, match="frames is over") as info:
        decode(encode(many), small)
    two = Message(MsgType.OBSERVATION, arrays={"a": np.zeros(1000, np.uint8), "b": np.zeros(1000, np.uint8)})
    with pytest.raises(ProtocolError, match="message is over"):
        decode(encode(two), small)
    with pytest.raises(ProtocolError, match="header of"):
        decode(encode(Message(MsgType.OBSERVATION, meta={"k": "x" * 1000})), small)


def test_a_known_array_table_is_still_checked_against_every_message_and_limit():
    """Array tables are checked once and kept (``codec._LAYOUTS``): a message that reuses
    a table must still have frames of the announced sizes, and each receiver's limits."""
    layout = [["obs/q", "float32", [2, 3]], ["done", "bool", [2]]]
    good = [header(a=layout), np.zeros((2, 3), np.float32).tobytes(), b"\x00\x01"]
    assert decode(good).arrays["done"].tolist() == [False, True]
    assert decode(good).arrays["obs/q"].shape == (2, 3)  # the second time from the kept table
    short = [good[0], good[1][:-4], good[2]]
    with pytest.raises(ProtocolError) as info:
        decode(short)
    assert info.value.code is ErrorCode.LENGTH_MISMATCH and "'obs/q'" in info.value.message
    with pytest.raises(ProtocolError) as info:
        decode(good[:2])
    assert info.value.code is ErrorCode.TRUNCATED
    with pytest.raises(ProtocolError, match="over the frame limit") as info:
        decode(good, Limits(max_frame_bytes=16))
    assert info.value.code is ErrorCode.TOO_LARGE
    with pytest.raises(ProtocolError, match="message is over") as info:
        decode(good, Limits(max_message_bytes=len(good[0]) + 24))
    assert info.value.code is ErrorCode.TOO_LARGE
    lying = [good[0], bytes(64), good[2]]  # a frame larger than the limit, whatever the table says
    with pytest.raises(ProtocolError, match="frame for array") as info:
        decode(lying, Limits(max_frame_bytes=32))
    assert info.value.code is ErrorCode.TOO_LARGE


def test_a_peer_cannot_grow_the_kept_array_tables_without_bound(monkeypatch):
    from gateway.protocol import codec

    monkeypatch.setattr(codec, "MAX_LAYOUTS", 8)
    monkeypatch.setattr(codec, "_LAYOUTS", {})
    for n in range(50):
        got = decode([header(a=[[f"k{n}", "uint8", [n]]]), bytes(n)])
        assert got.arrays[f"k{n}"].shape == (n,)
        assert len(codec._LAYOUTS) <= 8


def test_meta_of_subclasses_of_plain_types_travels_as_those_types():
    """A version string that is a ``str`` subclass (``torch.__version__``) or a
    ``numpy.float64`` from a computation is sent as the plain value; a numpy ``int64``
    or an object is refused with BAD_HEADER, as before."""

    class Version(str):
        pass

    meta = {"torch": Version("2.13.0"), "mean": np.float64(0.25), "nested": [{"x": np.float64(1.5)}]}
    got = decode(encode(Message(MsgType.REPLY, meta=meta))).meta
    assert got == {"torch": "2.13.0", "mean": 0.25, "nested": [{"x": 1.5}]}
    assert type(got["torch"]) is str and type(got["mean"]) is float
    for bad in (np.int64(3), np.float32(1.0), object()):
        with pytest.raises(ProtocolError) as info:
            encode(Message(MsgType.REPLY, meta={"k": bad}))
        assert info.value.code is ErrorCode.BAD_HEADER


def test_object_arrays_cannot_be_sent():
    with pytest.raises(ProtocolError) as info:
        encode(Message(MsgType.OBSERVATION, arrays={"x": np.array([{"a": 1}], dtype=object)}))
    assert info.value.code is ErrorCode.BAD_DTYPE


def test_error_messages_raise_at_the_caller():
    msg = decode(encode(error_message("spec_mismatch", "observation 'q' is missing", ref=7)))
    with pytest.raises(RemoteError) as info:
        raise_for_error(msg)
    assert info.value.code == "spec_mismatch" and info.value.ref == 7 and "'q'" in info.value.message


def test_limits_validate_their_fields():
    with pytest.raises(ValueError, match=r"limits\.max_frames"):
        Limits(max_frames=0)


@pytest.mark.unit
def test_every_message_layout_is_declared_and_checked_next_to_the_codec():
    from gateway.protocol.schemas import SCHEMAS, WORKER_OBSERVATION

    assert {s.type for s in SCHEMAS} >= {MsgType.OBSERVATION, MsgType.ACTION, MsgType.INFER, MsgType.STEP}
    assert all(s.doc for s in SCHEMAS)
    good = Message(
        MsgType.OBSERVATION,
        arrays={
            "obs/q": np.zeros((2, 3), np.float32),
            "step_info": np.zeros((2, 8)),
            "prev/action": np.zeros(2),
        },
    )
    assert WORKER_OBSERVATION.problems(good) == []
    bad = Message(MsgType.OBSERVATION, arrays={"q": np.zeros(2), "step_info": np.zeros((2, 8))})
    assert WORKER_OBSERVATION.problems(bad) == [
        "no obs/* arrays",
        "unexpected array(s) ['q'] in a worker observation",
    ]
    assert "INFER" in WORKER_OBSERVATION.problems(Message(MsgType.INFER, arrays=good.arrays))[0]


def test_a_schema_answers_a_repeated_set_of_names_the_same_and_still_checks_meta(monkeypatch):
    """A schema keeps its answer per set of array names (a peer repeats them every
    message); the type and the meta are checked on every message, and the kept answers
    are bounded."""
    from gateway.protocol import schemas
    from gateway.protocol.schemas import CLIENT_OBSERVATION

    arrays = {"obs/q": np.zeros((1, 3)), "step_info": np.zeros((1, 8))}
    with_meta = Message(MsgType.OBSERVATION, meta={"worker": 0, "reset": False}, arrays=arrays)
    for _ in range(3):
        assert CLIENT_OBSERVATION.problems(with_meta) == []
    assert CLIENT_OBSERVATION.problems(Message(MsgType.OBSERVATION, meta={"worker": 0}, arrays=arrays)) == [
        "meta 'reset' is missing"
    ]
    assert CLIENT_OBSERVATION.problems(Message(MsgType.ACTION, meta=with_meta.meta, arrays=arrays)) == [
        "client observation is a OBSERVATION message, got ACTION"
    ]
    extra = Message(MsgType.OBSERVATION, meta=with_meta.meta, arrays={**arrays, "prev/action": np.zeros(1)})
    for _ in range(2):
        assert CLIENT_OBSERVATION.problems(extra) == [
            "unexpected array(s) ['prev/action'] in a client observation"
        ]
    monkeypatch.setattr(schemas, "MAX_SEEN", 4)
    for n in range(20):
        names = {**arrays, **{f"obs/k{i}": np.zeros(1) for i in range(n)}}
        assert (
            CLIENT_OBSERVATION.problems(Message(MsgType.OBSERVATION, meta=with_meta.meta, arrays=names)) == []
        )
        assert len(CLIENT_OBSERVATION._seen) <= 4
