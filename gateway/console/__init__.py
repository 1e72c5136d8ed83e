"""The web console: a browser view of a running experiment for lab staff.

A FastAPI + WebSocket app served by uvicorn (``python -m gateway.console``, ``loopgate
console --run-dir RUN``, or ``loopgate up`` when the config's ``console:`` block enables
it). It talks to the gateway only through the gateway's public clients: the control
socket (:class:`gateway.control_client.ControlClient`: status, e-stop, resume) and the
client socket (:class:`gateway.client.GatewayVectorEnv` with ``takeover=True``) for
teleoperation. See ``docs/console.md``.

Importing this package imports nothing heavy: the config block
(:mod:`gateway.console.config`) is built for every experiment, console or not.
"""
