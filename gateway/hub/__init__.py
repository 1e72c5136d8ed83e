"""The gateway service: env workers in, actions out, every step recorded before it is acknowledged.

- :mod:`gateway.hub.core`: :class:`~gateway.hub.core.Gateway`, the event loop;
- :mod:`gateway.hub.state`: worker sessions, the collection state, and the narrow
  interface (:class:`~gateway.hub.state.Hub`) the desks below use;
- :mod:`gateway.hub.control`: the control socket (status, pause, e-stop, drain, ...);
- :mod:`gateway.hub.clients`: :mod:`gateway.client` envs driving workers;
- :mod:`gateway.hub.assembly`: a gateway built from a config and a run folder;
- ``python -m gateway.hub``: the process (:mod:`gateway.hub.__main__`).
"""

from gateway.hub.core import Gateway
from gateway.hub.state import Collection, WorkerSession

__all__ = ["Collection", "Gateway", "WorkerSession"]
