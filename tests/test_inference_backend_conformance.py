"""Both inference backends prove the backend contract on the CPU: onnxruntime and torch."""

from __future__ import annotations

from tests.conformance.inference_backend import InferenceBackendConformance


class TestOnnxruntimeBackendConformance(InferenceBackendConformance):
    backend = "onnxruntime"


class TestTorchBackendConformance(InferenceBackendConformance):
    backend = "torch"
