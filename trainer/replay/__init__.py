"""The replay service: tables fed by the gateway, a durable log, sampling for trainers.

- :mod:`trainer.replay.config`: the ``replay:`` block (tables, rate limiters, log);
- :mod:`trainer.replay.table`, :mod:`.samplers`, :mod:`.rate_limiter`, :mod:`.storage`,
  :mod:`.core`: tables over episode data stored once;
- :mod:`trainer.replay.log`, :mod:`.ingest`, :mod:`.service`: the process, its durable
  log and its sockets (``python -m trainer.replay``, ``loopgate replay``);
- :mod:`trainer.replay.sink`: the gateway's sink to it; :mod:`.client`: the trainer's;
- :mod:`trainer.replay.export`: ``loopgate export`` (LeRobot v3, MCAP).

See ``docs/replay.md``.
"""
