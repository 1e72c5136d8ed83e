"""The inference server: batched policy serving with versioned, hot-swapped weights.

Gateways send batches of observations with a deadline; servers batch requests across
every connected gateway, run the policy network (onnxruntime or torch, CPU or GPU) off
the socket thread and answer with actions and the policy version that produced them.
A trainer publishes new weights while serving goes on; several servers are balanced by
the gateway's :class:`~inference.client.InferenceSource`.

    loopgate up configs/reach_sim.yaml --set policy.kind=inference --set inference.enabled=true
    python -m inference --config configs/reach_sim.yaml --run-dir runs/inf   # one server alone

Modules: :mod:`~inference.config` (the ``inference`` config block and the
network config), :mod:`~inference.server` (the process),
:mod:`~inference.backends` (onnxruntime and torch),
:mod:`~inference.weights` (wire format, validation, :class:`WeightsPublisher`),
:mod:`~inference.client` (the gateway's action source),
:mod:`~inference.services` (``loopgate up`` plan, preflight, summary). The
protocol is in ``docs/inference.md``.
"""
