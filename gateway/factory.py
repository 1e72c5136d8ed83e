"""One generic factory: config blocks, backends and policies from plain mappings.

:func:`build` turns a mapping (a YAML block, ``env.options``, ``policy.options``) into
its frozen dataclass, naming the field of every bad value (``env.options.success_radius
must be >= 0, got -1``); :func:`make_backend` and :func:`experiment_spec` resolve a
backend through :mod:`gateway.registry` and build it with its validated options::

    backend = make_backend("mujoco_reach", num_envs=4, seed=0, options={"success_radius": 0.05})
    spec = experiment_spec("gymnasium", {"id": "Reacher-v5"})   # one line if it cannot be built
"""

from __future__ import annotations

import dataclasses
import logging
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from gateway.registry import BACKENDS, missing_package, resolve

log = logging.getLogger(__name__)


class ConfigError(ValueError):
    """An invalid config; the message names the field (``block.key``) and the value."""


# ----------------------------------------------------------------------------- blocks


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def coerce(tp: Any, value: Any, where: str) -> Any:
    """Check (and gently convert) ``value`` against annotation ``tp``."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return coerce(arg, value, where)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(
            errors[0] if len(errors) == 1 else f"{where}: {value!r} matches none of {_type_name(tp)}"
        )
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{where} must be one of {', '.join(map(repr, args))}, got {value!r}")
        return value
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where} must be a mapping, got {value!r}")
        return build(tp, value, where)
    if origin in (dict, Mapping) or tp is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where} must be a mapping, got {value!r}")
        vt = args[1] if len(args) == 2 else Any
        return {str(k): coerce(vt, v, f"{where}.{k}") for k, v in value.items()}
    if origin in (list, tuple, Sequence) or tp in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where} must be a list, got {value!r}")
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(args) != len(value):
                raise ConfigError(f"{where} must have {len(args)} elements, got {len(value)}")
            return tuple(coerce(a, v, f"{where}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
        et = args[0] if args else Any
        items = [coerce(et, v, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple or tp is tuple else items
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where} must be true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{where} must be an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{where} must be a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{where} must be a string, got {value!r}")
    if isinstance(tp, type) and isinstance(value, tp):
        return value
    raise ConfigError(f"{where}: cannot check a value of type {_type_name(tp)} (got {value!r})")


def build(cls: type, data: Mapping[str, Any], where: str) -> Any:
    """Build dataclass ``cls`` from ``data``; unknown keys and bad values name the field."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(fields))}")
    kwargs = {name: coerce(hints[name], value, f"{where}.{name}") for name, value in data.items()}
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError) as exc:
        text = str(exc)
        # Validators usually name the full field already ("env.options.max_delta ...").
        raise ConfigError(text if text.startswith(f"{where}.") else f"{where}: {text}") from exc


def make_backend(name: str, *, num_envs: int, seed: int = 0, options: dict[str, Any] | None = None) -> Any:
    """Build the episode backend registered as ``name`` with validated options.

    Every backend class has a ``Config`` dataclass for its options and the constructor
    ``Backend(config, *, num_envs, seed)``.
    """
    cls = resolve(BACKENDS, name, "backend")
    config = build(cls.Config, options or {}, "env.options")
    return cls(config, num_envs=num_envs, seed=seed)


def experiment_spec(backend: str, options: dict[str, Any] | None = None) -> Any:
    """The :class:`~gateway.episode.EnvSpec` a config's env block produces.

    Uses the backend's ``spec_for(config)`` class method when it has one (no simulator
    started); otherwise builds a one-env backend and reads its spec.
    """
    what = f"env.backend {backend!r}" + (f" (id {options['id']!r})" if options and "id" in options else "")
    try:
        cls = resolve(BACKENDS, backend, "backend")
    except ImportError as exc:
        raise ConfigError(f"{what} cannot be imported: {missing_package(exc)}") from None
    config = build(cls.Config, options or {}, "env.options")
    try:
        if hasattr(cls, "spec_for"):
            return cls.spec_for(config)
        instance = cls(config, num_envs=1, seed=0)
    except ConfigError:
        raise
    except Exception as exc:
        # A third-party env can fail to build in any way; the user gets one line naming
        # it (the traceback is in the debug log), before any process starts.
        log.debug("building %s failed", what, exc_info=True)
        cause: BaseException | None = exc
        while cause is not None and not isinstance(cause, ImportError):
            cause = cause.__cause__ or cause.__context__
        reason = missing_package(cause) if cause is not None else f"{type(exc).__name__}: {exc}"
        raise ConfigError(f"{what} cannot be built: {reason}") from None
    try:
        return instance.spec
    finally:
        instance.close()
