"""Env workers: host a batch of envs of one backend and stream it through a gateway.

A worker registers its backend's :class:`~gateway.episode.EnvSpec` with the gateway
(HELLO -> WELCOME, or ERROR ``spec_mismatch``), then loops: send an OBSERVATION (the
new observations plus the results of the previous step), wait for the ACTION, step.
While it waits it sends heartbeats; if the gateway stays silent past
``gateway_timeout_s`` it reconnects by itself and resends its last observation with
the previous step's observation and action attached (``prev/*``), so a restarted
gateway can record that step; the gateway drops steps it already has.

    python -m gateway.worker --connect tcp://127.0.0.1:5555 --backend mujoco_reach --num-envs 4

With a tap address (``endpoints.json["taps"][index]`` under ``loopgate up``) it also
publishes each observation for watchers such as the web console (:mod:`gateway.tap`:
only while someone listens, never blocking the loop).

Message layout (``K`` = num_envs)::

    OBSERVATION  meta: uid, rtt_us, reset (bool), hops_us {action_to_worker, env_step},
                 env_log {name: float} (the backend's info["log"], on steps that have one)
                 (the previous ACTION's way here and the step it made, in µs)
                 obs/<key> [K, ...], step_info f64[K, 8] (gateway.steps.COLUMNS:
                 episode and step of these observations, t_capture, has_prev, and
                 reward, terminated, truncated, success of the step they complete),
                 final_obs/<key> [K, ...] (when an episode ended),
                 prev/obs/<key>, prev/action, prev/policy_version, prev/t_action,
                 prev/t_capture, prev/episode, prev/step (first message after a
                 reconnect: the step this message completes)
    ACTION       seq = the observation's seq; action [K, ...]; meta: version (one
                 policy version for every env) or an array policy_version i64[K],
                 acked (steps stored durably with this observation), t_action
    RESET        meta: seed, options  -> the worker resets every env and answers
                 with an OBSERVATION whose meta has reset=True
"""

from gateway.worker.core import EXIT_CONFIG, EnvWorker, FatalWorkerError, action_versions

__all__ = ["EXIT_CONFIG", "EnvWorker", "FatalWorkerError", "action_versions"]
