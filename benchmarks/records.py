"""Benchmark records, their baselines and the JSON that scripts read.

A suite returns :class:`Record` objects; :func:`finish` resolves each record's
baseline (another record of the same run, by name) into ``baseline_value`` and
``ratio = value / baseline_value``. The JSON written by ``loopgate bench --json`` is a
list of::

    {"name": "gateway.rtt_p50_us.4KiB", "value": 151.2, "unit": "us",
     "baseline": "zmq.rtt_p50_us.4KiB", "baseline_value": 70.3, "ratio": 2.15,
     "repeats": [150.1, 151.2, 155.0], "note": "...", "target": "ratio <= 2.5", "met": true}

Record names are a contract (scripts compare runs by them): change one only with a
changelog entry. A baseline record itself has ``baseline``, ``baseline_value`` and
``ratio`` null; so does a record whose baseline was not measured in this run.
"""

from __future__ import annotations

import math
import operator
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

_OPS = {"<=": operator.le, ">=": operator.ge}


@dataclass(frozen=True, kw_only=True)
class Record:
    """One figure of one benchmark."""

    name: str
    """Stable dotted name, e.g. ``collect.steps_per_s.n16``."""
    value: float
    """The reported figure: the median over ``repeats``."""
    unit: str
    """``us``, ``steps/s``, ..."""
    baseline: str | None = None
    """Name of the record this one is compared with (same run, same placement)."""
    repeats: tuple[float, ...] = ()
    """The figure of each repeat, in the order measured."""
    note: str = ""
    """How it was measured, where that is not obvious from the name."""
    target: str | None = None
    """A goal on the ratio, ``"<= 2.5"``, ``">= 2"`` or ``"0.8 .. 1.2"``; reported, never asserted."""

    @classmethod
    def median_of(cls, name: str, values: Sequence[float], unit: str, **kwargs: Any) -> Record:
        """A record whose value is the median of per-repeat ``values``."""
        if not values:
            raise ValueError(f"{name}: no repeats measured")
        return cls(
            name=name,
            value=float(statistics.median(values)),
            unit=unit,
            repeats=tuple(float(v) for v in values),
            **kwargs,
        )


@dataclass
class Result:
    """A record with its baseline resolved; what the table and the JSON show."""

    record: Record
    baseline_value: float | None = None
    ratio: float | None = None
    met: bool | None = None

    def to_json(self) -> dict[str, Any]:
        r = self.record
        out: dict[str, Any] = {
            "name": r.name,
            "value": r.value,
            "unit": r.unit,
            "baseline": r.baseline if self.baseline_value is not None else None,
            "baseline_value": self.baseline_value,
            "ratio": self.ratio,
            "repeats": list(r.repeats),
        }
        if r.note:
            out["note"] = r.note
        if r.target is not None:
            out["target"] = f"ratio {r.target}"
            out["met"] = self.met
        return out


def _target_met(target: str, ratio: float) -> bool:
    low, sep, high = target.partition("..")
    if sep:  # a range, "0.8 .. 1.2"
        return float(low) <= ratio <= float(high)
    op, _, bound = target.strip().partition(" ")
    if op not in _OPS:
        raise ValueError(f"target {target!r} must look like '<= 2.5', '>= 2' or '0.8 .. 1.2'")
    return bool(_OPS[op](ratio, float(bound)))


def select(records: Iterable[Record], only: str | None) -> list[Record]:
    """Records whose name contains ``only``, plus the baselines they refer to."""
    records = list(records)
    if only is None:
        return records
    keep = {r.name for r in records if only in r.name}
    keep |= {r.baseline for r in records if r.name in keep and r.baseline}
    return [r for r in records if r.name in keep]


def finish(records: Iterable[Record]) -> list[Result]:
    """Resolve baselines and ratios; duplicate names are a bug in a suite."""
    records = list(records)
    by_name: dict[str, Record] = {}
    for r in records:
        if r.name in by_name:
            raise ValueError(f"two records are named {r.name!r}")
        by_name[r.name] = r
    results = []
    for r in records:
        base = by_name.get(r.baseline) if r.baseline else None
        res = Result(r)
        if base is not None:
            res.baseline_value = base.value
            if base.value != 0 and math.isfinite(base.value):
                res.ratio = r.value / base.value
                if r.target is not None:
                    res.met = _target_met(r.target, res.ratio)
        results.append(res)
    return results
