"""The gradient noise scale, measured in every run: how large a batch still pays (docs/scaling-pays.md).

McCandlish et al. 2018 (arXiv 1812.06162) define the simple noise scale ``B_simple = tr(Σ) / |G|²``: Σ is the
per-sample gradient covariance, G the true gradient. A step on a batch of B samples is about as good as B steps on
one while B is well below B_simple, and buys little more past it. Their appendix A estimates both terms without
bias from the squared norms of two gradients of the same weights at two batch sizes, b < B:

    E|g_b|² = |G|² + tr(Σ)/b,  so  |G|² ≈ (B|g_B|² - b|g_b|²)/(B - b)  and  tr(Σ) ≈ (|g_b|² - |g_B|²)/(1/b - 1/B)

Here b is one micro-batch on one rank and B the optimizer step's global batch: every engine computes each rank's
micro-batch gradient before it reduces anything (:meth:`~scale_ocr.strategies.base.Strategy.tap_gradients`), and
reports the global gradient's norm after (``StepStats.grad_norm``). A run on one process with ``--grad-accum 1``
has one batch size only, and measures nothing. Each estimate alone is noisy (it may even be negative), so |G|² and
tr(Σ) are averaged separately, as the paper does, with a bias-corrected exponential moving average, and their ratio
is B_simple.

A gradient spike (a step whose global gradient is many times the usual) gives one |G|² reading tens of times the
others; averaged in whole it would hold B_simple down for the rest of the run, and two engines whose runs differ in
their last bits spike at different steps. So a reading counts at most :data:`CLIP` times the median size of the
:data:`RECENT` readings before it, once there are :data:`SETTLED` of them (readings within that, nearly all of them,
count as they are).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from scale_ocr.distributed.process_group import all_reduce_sum
from scale_ocr.errors import UserError

DEFAULT_EVERY = 10  # steps between readings when --noise-every is left out (its cost: docs/scaling-pays.md)
CLIP = 5.0  # a reading counts at most this many times the median size of the recent ones
RECENT = 8  # readings whose median size bounds the next
SETTLED = 4  # readings before any is bounded (early training moves |G|² tenfold in a few readings)


@dataclass(frozen=True)
class Pair:
    """One step's two gradients: the mean squared norm over this step's micro-batch gradients of ``small`` samples
    each (every rank's, every micro-step's), and the squared norm of the step's gradient over ``big`` samples."""

    small_sq: float
    big_sq: float
    small: int
    big: int

    def terms(self) -> tuple[float, float]:
        """The unbiased estimates of |G|² and tr(Σ) from this pair (appendix A of McCandlish et al.)."""
        b, big = self.small, self.big
        grad_sq = (big * self.big_sq - b * self.small_sq) / (big - b)
        trace = (self.small_sq - self.big_sq) / (1 / b - 1 / big)
        return grad_sq, trace


class NoiseScale:
    """|G|² and tr(Σ), each a bias-corrected exponential moving average of the per-step estimates with weight
    ``smoothing`` on the past (Adam's correction, so the first readings are not pulled towards zero)."""

    def __init__(self, smoothing: float) -> None:
        self.smoothing = smoothing
        self.grad_sq = self.trace = 0.0  # the raw averages; read through the properties
        self.count = 0
        self.small = self.big = 0
        self.recent: tuple[deque, deque] = (deque(maxlen=RECENT), deque(maxlen=RECENT))  # sizes of raw readings
        self.clipped = 0  # readings that counted less than they read

    def _bounded(self, value: float, recent: deque) -> float:
        """``value`` within CLIP times the median size of ``recent`` (once SETTLED), which then takes its size."""
        bounded = value
        if len(recent) >= SETTLED:
            bound = CLIP * statistics.median(recent)
            bounded = max(-bound, min(value, bound))
        recent.append(abs(value))
        return bounded

    def add(self, pair: Pair) -> None:
        raw = pair.terms()
        grad_sq, trace = (self._bounded(v, recent) for v, recent in zip(raw, self.recent, strict=True))
        self.clipped += (grad_sq, trace) != raw
        beta = self.smoothing
        self.grad_sq = beta * self.grad_sq + (1 - beta) * grad_sq
        self.trace = beta * self.trace + (1 - beta) * trace
        self.count += 1
        self.small, self.big = pair.small, pair.big

    def _debiased(self, value: float) -> float:
        return value / (1 - self.smoothing ** self.count)

    @property
    def b_simple(self) -> float | None:
        """tr(Σ)/|G|², None before the first reading or while the averaged |G|² is not positive (a gradient too
        small to tell from its noise: any batch would do no better than the smallest)."""
        if not self.count:
            return None
        grad_sq, trace = self._debiased(self.grad_sq), self._debiased(self.trace)
        return trace / grad_sq if grad_sq > 0 and trace > 0 else None

    def metrics(self) -> dict[str, float]:
        """The ``noise/*`` metrics of a log record (nothing before the first reading)."""
        if not self.count:
            return {}
        found = {"noise/grad_sq": self._debiased(self.grad_sq), "noise/trace": self._debiased(self.trace),
                 "noise/b_small": self.small, "noise/b_big": self.big, "noise/smoothing": self.smoothing,
                 "noise/clipped": self.clipped}
        return ({"noise/b_simple": self.b_simple} if self.b_simple is not None else {}) | found

    def state_dict(self) -> dict[str, Any]:
        return {"grad_sq": self.grad_sq, "trace": self.trace, "count": self.count, "small": self.small,
                "big": self.big, "smoothing": self.smoothing, "clipped": self.clipped,
                "recent": [list(r) for r in self.recent]}

    def load_state_dict(self, state: dict[str, Any]) -> bool:
        """Continue the averages a checkpoint kept, when they were made with this smoothing; False (and a fresh
        start) when they were not, or are not numbers of the kinds this writes."""
        numbers = [state.get(k) for k in ("grad_sq", "trace")]
        counts = [state.get(k, 0) for k in ("count", "small", "big", "clipped")]
        recent = state.get("recent", [[], []])  # a checkpoint from before bounded readings: none kept
        sizes = [v for r in recent for v in r] if isinstance(recent, list) and len(recent) == 2 and all(
            isinstance(r, list) and len(r) <= RECENT for r in recent) else None
        if (state.get("smoothing") != self.smoothing or sizes is None
                or not all(isinstance(v, float) and math.isfinite(v) for v in numbers)
                or not all(isinstance(v, float) and math.isfinite(v) and v >= 0 for v in sizes)
                or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in counts)):
            return False
        self.grad_sq, self.trace = numbers
        self.count, self.small, self.big, self.clipped = counts
        self.recent = tuple(deque(r, maxlen=RECENT) for r in recent)  # type: ignore[assignment]
        return True

    def restart_note(self, state: dict[str, Any]) -> str:
        """The resume line's words when :meth:`load_state_dict` did not continue ``state``'s averages."""
        if state.get("smoothing") != self.smoothing:
            return (f"the noise scale's averages started afresh (the checkpoint's were made with --noise-smoothing "
                    f"{state.get('smoothing')}, this run's is {self.smoothing:g})")
        return "the noise scale's averages started afresh (the checkpoint's are not of the kind this version writes)"


def two_batch_sizes(micro_batch: int, global_batch: int) -> bool:
    """Whether a run has the two batch sizes the noise scale compares: a step larger than a micro-batch (2 or more
    ranks, or accumulation)."""
    return global_batch > micro_batch


def check_every(every: int | None, micro_batch: int, global_batch: int) -> None:
    """Refuse (:class:`~scale_ocr.errors.UserError`) a cadence asked of a run that has one batch size: it asks for
    what cannot be measured. train.py asks before it builds anything, the meter again when it is made."""
    if every and not two_batch_sizes(micro_batch, global_batch):
        raise UserError(f"--noise-every {every}: the gradient noise scale compares gradients at two batch sizes, "
                        "and one process with --grad-accum 1 has one; run on 2 or more ranks or with --grad-accum "
                        "2 or more, or leave --noise-every out")


class NoiseMeter:
    """Measures the noise scale every ``every`` optimizer steps under any strategy.

    On a measured step each micro-batch's local gradient is read, as the backward produces it, by hooks the
    strategy places (:meth:`~scale_ocr.strategies.base.Strategy.tap_gradients`): one extra read of the gradients
    and one all-reduce of two numbers. The hooks are placed for that step's backwards and removed after them, so
    the steps in between run exactly as with the measurement off (which is what makes its cost measurable within
    one run: benchmarks/noise_scale.py).
    """

    def __init__(self, strategy, every: int | None, smoothing: float, micro_batch: int, global_batch: int,
                 device: torch.device) -> None:
        """``every`` None: every :data:`DEFAULT_EVERY` steps where the run has two batch sizes, else never; a number
        where it has one is refused (:class:`~scale_ocr.errors.UserError`): it asks for what cannot be measured."""
        self.small, self.big = micro_batch, global_batch
        check_every(every, micro_batch, global_batch)
        self.strategy, self.device = strategy, device
        self.every = (DEFAULT_EVERY if two_batch_sizes(micro_batch, global_batch) else 0) if every is None else every
        self.scale = NoiseScale(smoothing)
        self.active = False
        self._norms: list[torch.Tensor] = []  # this micro-batch's gradient norms so far, a tensor at a time
        self._micro: list[torch.Tensor] = []
        self._gradient_scale = 1.0
        self.handles: list = []

    @property
    def measures(self) -> bool:
        """Whether this run measures at all (``every`` as resolved: off by default where there is one batch size)."""
        return self.every > 0

    def due(self, step: int) -> bool:
        """Whether optimizer step ``step`` (counted from 1) is measured."""
        return self.measures and step % self.every == 0

    def _on_grad(self, grad: torch.Tensor) -> None:
        if self.active:  # a norm is one fused read (a square would write a gradient-sized temporary first)
            self._norms.append(torch.linalg.vector_norm(grad.detach(), dtype=torch.float32).to(self.device))

    def begin(self) -> None:
        """Read the gradients of this step's micro-batches: the strategy's hooks are placed now."""
        self.remove()  # a step that raised before its end_backward left them
        self.active, self._micro = True, []
        self.handles = self.strategy.tap_gradients(self._on_grad)

    def end_micro(self) -> None:
        """One micro-batch's backward is done: keep its squared norm."""
        if self.active:
            norms = torch.stack(self._norms) if self._norms else torch.zeros(1, device=self.device)
            self._micro.append(norms.square().sum())
            self._norms = []

    def end_backward(self) -> None:
        """The step's last backward is done: stop reading, and note the engine's gradient scale (loss scaling,
        accumulation) while it is the one these gradients were made with."""
        if self.active:
            self.active = False
            self._gradient_scale = self.strategy.gradient_scale()
            self.remove()

    def resize(self, global_batch: int) -> None:
        """The optimizer step's batch from the next step on (``--batch-ramp`` grew it)."""
        self.big = global_batch

    def record(self, grad_norm: float | torch.Tensor, good: bool) -> bool:
        """After a measured step: the ranks' micro-batch norms against the step's global norm (a collective, on
        every rank at the same steps). A bad or skipped step adds nothing (its gradients were not used). Returns
        whether a reading was added."""
        local = float(torch.stack(self._micro).sum()) if self._micro else 0.0
        total, count = all_reduce_sum([local, len(self._micro)], self.device)
        self._micro = []
        big_sq = float(grad_norm) ** 2
        if not good or not count or not math.isfinite(total) or not math.isfinite(big_sq):
            return False
        small_sq = total / count / self._gradient_scale ** 2
        self.scale.add(Pair(small_sq, big_sq, self.small, self.big))
        return True

    def metrics(self) -> dict[str, float]:
        return self.scale.metrics() if self.measures else {}

    def describe(self) -> str:
        """The log line's words: B_simple and the two batches it compares."""
        value = self.scale.b_simple
        if value is None:
            return ""
        return f"B_simple={value:.0f} (b {self.scale.small}/{self.scale.big})"  # the last reading's batches

    def summary(self) -> dict[str, Any] | None:
        """metrics.json's ``noise_scale``: the last smoothed values and how they were measured."""
        if not self.measures:
            return None
        return {"b_simple": self.scale.b_simple, **{k.split("/")[1]: v for k, v in self.scale.metrics().items()
                                                     if k != "noise/b_simple"},
                "every": self.every, "readings": self.scale.count}

    def remove(self) -> None:
        """Take the strategy's hooks out (after a measured step's last backward)."""
        for handle in self.handles:
            handle.remove()
        self.handles = []

