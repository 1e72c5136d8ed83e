"""Both inference backends prove the backend contract on the CPU: onnxruntime and torch."""

from __future__ import annotations

import gc
import os
import tempfile
from pathlib import Path

import numpy as np
import pytest

from inference.backends import OrtBackend, make_backend
from inference.config import InferenceConfig
from networks.modules import export_onnx, make_actor
from tests.conformance.inference_backend import NETWORK, SPEC, InferenceBackendConformance, batch, reference


class TestOnnxruntimeBackendConformance(InferenceBackendConformance):
    backend = "onnxruntime"


class TestTorchBackendConformance(InferenceBackendConformance):
    backend = "torch"


def _opens(path: str) -> str:
    """What ``path`` opens: a memory file's name, or the path itself ('' once gone)."""
    if path.startswith("/proc/self/fd/"):
        try:
            return os.readlink(path)
        except FileNotFoundError:
            return ""
    return path if os.path.exists(path) else ""


@pytest.mark.parametrize("memfd", [True, False], ids=["memfd", "temp_folder"])
def test_onnxruntime_graph_files_live_as_long_as_their_graph(monkeypatch, tmp_path, memfd):
    """A superseded graph's file is released at once, the serving one's when the backend
    goes; without ``memfd_create`` (not Linux) the files sit in a temp folder instead.
    (onnxruntime keeps a small session-id file of its own, ``.ses``, in the temp folder.)"""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)  # read TMPDIR again
    if not memfd:
        monkeypatch.delattr(os, "memfd_create")

    def ours() -> list[str]:
        return [p.name for p in tmp_path.iterdir() if p.name != ".ses"]

    backend = make_backend(SPEC, InferenceConfig(backend="onnxruntime", network=NETWORK))
    assert isinstance(backend, OrtBackend)
    backend.initial()
    first_path = backend.base
    first = _opens(first_path)
    actor = make_actor(SPEC, NETWORK, seed=4)
    policy = backend.from_onnx(np.frombuffer(export_onnx(actor), np.uint8), 2)
    serving = _opens(backend.base)
    assert first and serving and serving != first
    assert _opens(first_path) != first  # superseded: released
    assert ours() == ([] if memfd else [Path(backend.base).parent.name])
    assert "version-2-" in serving and _opens(backend.base) == serving
    obs, eps = batch(SPEC, 3, seed=5)
    np.testing.assert_allclose(policy.run(obs, eps), reference(actor, obs, eps), atol=1e-5)
    path = backend.base
    del backend, policy
    gc.collect()
    assert _opens(path) != serving
    assert ours() == []
