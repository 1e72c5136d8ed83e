"""The policy network: one home for what the trainer and the inference servers must agree on.

- :mod:`networks.config`: :class:`~networks.config.NetworkConfig` (``inference.network``)
  and the torch-free checks that it fits an env spec;
- :mod:`networks.modules`: the torch modules (observation encoder, actor), their
  numpy state dicts and the ONNX export.
"""
