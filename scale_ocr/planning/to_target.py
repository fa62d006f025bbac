"""Steps and samples to a target accuracy at any global batch, anchored on one run (``scale-ocr plan``).

McCandlish et al. (2018, arXiv 1812.06162): for a fixed target, the optimizer steps S and samples E = B x S a
global batch B needs trade off as (S/S_min - 1)(E/E_min - 1) = 1, that is S(B) = S_min (1 + B_crit/B) with
B_crit = E_min/S_min, and their gradient noise scale B_simple (measured in every run, docs/scaling-pays.md)
estimates B_crit. For a whole run to a target the knee is B_simple averaged along the way (:func:`path_mean`): if
every stretch obeys the relation with its own noise scale B(t), a step at batch B makes 1 / (1 + B(t)/B) of an
ideal step, and summing gives S(B) = S_min + mean(B(t) over the ideal steps) S_min / B. One run at batch B0 that
reached the target in S0 steps, with B_crit that mean, gives S_min = S0 / (1 + B_crit/B0), and so S(B) at every
other batch. B_simple read at the target instead overstates the knee more and more as training converges: |G|^2
falls toward its estimate's noise.

How far to trust it: the critical-batch record (benchmarks/results/critical-batch-vm-20261207-refit) found the knee
fitted from steps-to-target within 1.4x of B_simple along the way at 30-90% exact match on synthetic words and
30-70% on real-looking crops, and 2.31x at 80% on crops. The band this module states takes B_crit from
B_simple / SPREAD to B_simple x SPREAD; at the anchor's own batch it is exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

SPREAD = 2.0  # B_crit taken within this factor of B_simple along the way: the record's agreement (issue 54, acc. 3)


def first_reach(steps: Sequence[int], values: Sequence[float], target: float) -> int | None:
    """The step of the first validation at or above ``target`` (the measurements as logged, no interpolation)."""
    return next((s for s, v in zip(steps, values, strict=True) if v >= target), None)


def value_at(steps: Sequence[int], values: Sequence[float], step: int) -> float | None:
    """The last value logged at or before ``step`` (a smoothed series such as B_simple), or None."""
    found = None
    for s, v in zip(steps, values, strict=True):
        if s > step:
            break
        found = v
    return found


def path_mean(steps: Sequence[int], values: Sequence[float], upto: int, batch: float) -> float | None:
    """B_simple averaged along a run's way to step ``upto``: its readings (``steps``, ``values``) each weighted by
    1 / (1 + B_simple / ``batch``), the ideal steps a step at the run's batch makes there; None without one."""
    readings = [v for s, v in zip(steps, values, strict=True) if s <= upto and v > 0]
    if not readings or not batch > 0:
        return None
    weights = [1 / (1 + b / batch) for b in readings]
    return sum(b * w for b, w in zip(readings, weights, strict=True)) / sum(weights)


def seconds_to(step: int, steps: Sequence[int], step_times: Sequence[float]) -> float:
    """Training seconds up to ``step`` from the logged mean step times (each over the steps since the previous
    record): validation, checkpoints and start-up are left out, as the prediction leaves them out."""
    total, previous = 0.0, 0
    for s, t in zip(steps, step_times, strict=True):
        if s > step:
            break
        total += t * (s - previous)
        previous = s
    return total


@dataclass(frozen=True)
class StepsModel:
    """S(B) = S_min (1 + B_crit/B) for one target."""

    s_min: float
    b_crit: float

    @classmethod
    def anchored(cls, batch: int, steps: float, b_crit: float) -> StepsModel:
        """The model through a run at global ``batch`` that took ``steps`` to the target."""
        return cls(steps / (1 + b_crit / batch), b_crit)

    def steps(self, batch: float) -> float:
        return self.s_min * (1 + self.b_crit / batch)

    def samples(self, batch: float) -> float:
        return self.steps(batch) * batch

    @property
    def e_min(self) -> float:
        return self.s_min * self.b_crit


@dataclass(frozen=True)
class Band:
    """Steps to the target at a batch: the estimate with B_crit = B_simple, and the range over B_crit from
    B_simple / SPREAD to B_simple x SPREAD, every model through the same anchor."""

    steps: float
    low: float
    high: float

    def scaled(self, factor: float) -> Band:
        return Band(self.steps * factor, self.low * factor, self.high * factor)


def steps_band(anchor_batch: int, anchor_steps: float, b_simple: float, batch: float) -> Band:
    """:class:`Band` of steps at ``batch``: a larger B_crit predicts fewer steps above the anchor's batch and more
    below it, so the two ends are the two extreme models, in order."""
    ends = [StepsModel.anchored(anchor_batch, anchor_steps, b_simple * f).steps(batch) for f in (1 / SPREAD, SPREAD)]
    return Band(StepsModel.anchored(anchor_batch, anchor_steps, b_simple).steps(batch), min(ends), max(ends))
