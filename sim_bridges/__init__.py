"""Simulators behind loopgate's episode interface.

- :mod:`sim_bridges.reach`: the reach task in numpy (shared with real arms) and its
  scripted ``reach_pd`` policy.
- :mod:`sim_bridges.mujoco`: the ``mujoco_reach`` backend and the ``loopgate/Reach-v0``
  Gymnasium env.
- :mod:`sim_bridges.gymnasium`: any registered Gymnasium env as the ``gymnasium`` backend.
- :mod:`sim_bridges.rendering`: headless OpenGL selection and batched MuJoCo cameras.

Backends are looked up by name in ``gateway.registry.BACKENDS``; importing this package
imports no simulator.
"""
