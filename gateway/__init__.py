"""loopgate: a robot-in-the-loop experience collection gateway.

The ``gateway`` package holds the hub of the data path: the wire protocol
(:mod:`gateway.protocol`), the episode interface (:mod:`gateway.episode`), the gateway
process (:mod:`gateway.hub`), env workers (:mod:`gateway.worker`), the Gymnasium client
(:mod:`gateway.client`), config loading (:mod:`gateway.config`) and the ``loopgate`` CLI
(:mod:`gateway.cli`).
"""

__version__ = "0.1.0"
