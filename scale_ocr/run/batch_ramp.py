"""A global batch that grows while it pays (``--batch-ramp auto``; docs/scaling-pays.md).

A step on B samples is worth about B steps on one while B is well under the gradient noise scale B_simple, and
little more past it (McCandlish et al. 2018, arXiv 1812.06162); B_simple grows as the loss falls, and warming the
batch up with it trained OLMo-1B in 43% fewer steps (Merrill et al. 2025, arXiv 2505.23971). So the ramp reads the
run's own B_simple (:mod:`scale_ocr.run.noise_scale`) and grows the gradient accumulation (at most doubling it),
and with it the global batch, to the largest batch within ``--ramp-limit`` times B_simple and ``--ramp-max-batch``.

Why half of B_simple by default. In McCandlish et al.'s model a target takes S = S_min (1 + B_noise/B) steps and
E = E_min (1 + B/B_noise) samples, with B_simple their estimate of B_noise. At B = B_noise a run takes twice the
fewest steps and twice the fewest samples; at B = B_noise/2 three times the steps and 1.5 times the samples. OCR sets
are small and runs are bounded in samples (epochs), so the default keeps the samples' price at 1.5x, and
``--ramp-limit 1`` buys fewer steps for 2x.

- It only grows: B_simple grows through training, and a batch that shrank back would give back the steps the larger
  one saved. A change needs the room at each of the last :data:`SETTLED` readings at the current batch (their lowest
  B_simple decides), so neither one reading nor a passing spike moves it: early in training B_simple can jump
  twofold for a few readings and fall back.
- Every rank takes the same decision: the proposals are reduced (max) at the readings' steps, which every rank
  measures alike, so a last-bit difference between ranks cannot split them.
- Its state is the global batch it reached, free of world size: a run resumed on more ranks keeps that batch with less
  accumulation (the nearest at or under it that this world can make), on fewer with more.
- The rate grows with the batch (``--ramp-lr``, sqrt by default): a change to batch G trains at the starting rate
  times sqrt(G / G0), G0 the batch the ramp started from. A rate held at the starting one left the ramp no faster
  than batch 32 on real-looking crops, where the sqrt rule reached the target in 16% of its steps
  (benchmarks/results/batch-ramp-vm-20261207-held against -sqrt); sqrt is the rule Adam-style updates call for
  (Malladi et al. 2022). The starting batch and rate are in the checkpoint, so a run resumed at another world size
  carries the rate from the same origin.
"""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

import torch

from scale_ocr.config import RAMP_LIMIT, TrainConfig
from scale_ocr.distributed.process_group import all_reduce_max
from scale_ocr.errors import UserError
from scale_ocr.optim import LRPlan, rate
from scale_ocr.run.noise_scale import SETTLED, two_batch_sizes

DEFAULT_MAX_GROWTH = 8  # --ramp-max-batch left out: the ramp stops at this many times the starting global batch


@dataclass(frozen=True)
class Change:
    """One growth of the global batch: after optimizer step ``step``, ``samples`` into the run, from ``before`` to
    ``after`` samples, on a B_simple of ``b_simple``."""

    step: int
    samples: int
    before: int
    after: int
    b_simple: float


class BatchRamp:
    """The accumulation, and so the global batch, each optimizer step takes: ``--grad-accum`` throughout, or grown
    by ``--batch-ramp auto`` (:meth:`propose`, :meth:`grow`)."""

    def __init__(self, train: TrainConfig, world_size: int, lr: LRPlan | None = None,
                 micro_batch: int | None = None) -> None:
        """A ramp's settings that cannot work are refused here (:class:`~scale_ocr.errors.UserError`), before the
        run builds anything. ``lr``: the run's rate plan at its starting batch, which a grown batch's rate is carried
        from (None: the rate is never carried, as in tests of the batch alone). ``micro_batch``: a rank's mean
        samples per micro-batch where they vary (``--batch-pixels``), else ``-b``."""
        self.per_accum = (micro_batch or train.batch_size) * world_size  # samples one more micro-batch adds
        self.start_accum = self.accum = train.grad_accum
        self.auto = train.batch_ramp == "auto"
        self.limit = train.ramp_limit
        self.max_batch = train.ramp_max_batch or DEFAULT_MAX_GROWTH * self.start_batch
        # The rule a grown batch's rate follows: --ramp-lr, else --lr-scaling's where it scales, else sqrt.
        scaling = lr.rule if lr is not None and lr.rule != "none" else "sqrt"
        self.lr_rule = train.ramp_lr or scaling
        # The batch and peak rate the ramp started from (a resumed ramp's: its checkpoint's).
        self.origin: tuple[int, float] | None = (lr.global_batch, lr.peak_lr) if lr is not None else None
        self._check(train)
        self.recent: deque[float] = deque(maxlen=SETTLED)  # B_simple at the readings since the last change
        self.changes: list[Change] = []
        self.resumed = False  # load_state_dict continued a checkpoint's ramp
        self.resume_note = ""  # ... and the words the resume line adds

    def _check(self, train: TrainConfig) -> None:
        if not train.ramp_limit > 0 or train.ramp_limit == float("inf"):  # NaN too
            raise UserError(f"--ramp-limit {train.ramp_limit:g}: give a positive multiple of B_simple, e.g. "
                            f"{RAMP_LIMIT}")
        if not self.auto:
            given = [f for f, on in (("--ramp-limit", train.ramp_limit != RAMP_LIMIT),
                                     ("--ramp-max-batch", train.ramp_max_batch is not None),
                                     ("--ramp-lr", train.ramp_lr is not None)) if on]
            if given:
                flags = " and ".join(given)
                raise UserError(f"{flags} {'is a setting' if len(given) == 1 else 'are settings'} of --batch-ramp "
                                f"auto, which is off: add --batch-ramp auto, or drop {flags}")
            return
        if train.noise_every == 0:
            raise UserError("--batch-ramp auto grows the batch by the measured noise scale, which --noise-every 0 "
                            "turns off: leave --noise-every out (every 10 steps) or give a number of steps")
        if not two_batch_sizes(train.batch_size, self.start_batch):
            raise UserError("--batch-ramp auto grows the batch by the gradient noise scale, which compares gradients "
                            "at two batch sizes, and one process with --grad-accum 1 has one: run on 2 or more ranks "
                            "or with --grad-accum 2 or more, or drop --batch-ramp")
        if train.profile_steps:
            raise UserError(f"--profile-steps {train.profile_steps} profiles a run's last steps, which --batch-ramp "
                            "auto does not know in advance: profile a run of a fixed batch, or drop one of them")
        if self.max_batch < 2 * self.start_batch:
            ranks = self.per_accum // train.batch_size
            raise UserError(f"--ramp-max-batch {self.max_batch}: under twice this run's starting global batch "
                            f"({self.start_batch}: {ranks} ranks x --batch-size {train.batch_size} x --grad-accum "
                            f"{train.grad_accum}), the ramp could never grow; give {2 * self.start_batch} or more, "
                            "or drop --batch-ramp")

    @property
    def start_batch(self) -> int:
        return self.per_accum * self.start_accum

    @property
    def global_batch(self) -> int:
        return self.per_accum * self.accum

    def propose(self, b_simple: float | None, read: bool, device: torch.device) -> int:
        """The accumulation the next steps take, after a measured step that added a reading (``read``) or not; a
        collective on every rank at every measured step (the ranks take the largest proposal)."""
        accum = self.accum
        if read and b_simple is not None:
            self.recent.append(b_simple)
        if self.auto and len(self.recent) == SETTLED:
            room = min(self.limit * min(self.recent), self.max_batch)
            accum = max(self.accum, min(2 * self.accum, int(room // self.per_accum)))
        return int(all_reduce_max(float(accum), device))

    def grow(self, accum: int, step: int, samples: int) -> Change | None:
        """Take ``accum`` (from :meth:`propose`) from the next step on; the change (with the lowest recent B_simple,
        which allowed it), or None when it is no growth."""
        if accum <= self.accum:
            return None
        change = Change(step, samples, self.global_batch, self.per_accum * accum,
                        float(min(self.recent, default=0.0)))
        self.accum = accum
        self.recent.clear()
        self.changes.append(change)
        return change

    def after_reading(self, noise, read: bool, state, device: torch.device) -> Change | None:
        """After a measured step (``read``: it added a reading to ``noise``, a NoiseMeter), the growth the ramp takes
        at the run's ``state`` (a RunState), if any; a collective at every measured step of a ramping run."""
        if not self.auto:
            return None
        return self.grow(self.propose(noise.scale.b_simple, read, device), state.step, state.samples)

    def apply(self, strategy, noise, schedule) -> None:
        """Have the engine, the noise meter and the schedule take this global batch from the next step on, at
        :meth:`rate`."""
        strategy.set_accumulation(self.accum)
        noise.resize(self.global_batch)
        schedule.set_plan(self.rate())

    def rate(self) -> LRPlan:
        """The rate at this global batch: the origin's peak rate carried by the ramp's rule from the origin's batch."""
        if self.origin is None:
            raise RuntimeError("BatchRamp.rate: this ramp was made without the run's rate plan")
        batch, peak = self.origin
        return LRPlan(peak, self.lr_rule, None if self.lr_rule == "none" else batch, self.global_batch)

    def describe(self, change: Change, lr_line: str) -> str:
        """The one line a change is said in."""
        return (f"scale-ocr: batch ramp: global batch {change.before} -> {change.after} after step {change.step} "
                f"({change.samples} samples in; B_simple at least {change.b_simple:.0f} over the last {SETTLED} "
                f"readings, x --ramp-limit {self.limit:g} "
                f"allows {self.limit * change.b_simple:.0f}, --ramp-max-batch {self.max_batch}): --grad-accum "
                f"{self.accum}, {lr_line}")

    def state_dict(self) -> dict[str, Any]:
        return {"global_batch": self.global_batch, "recent": list(self.recent),
                "changes": [asdict(c) for c in self.changes], "origin": list(self.origin) if self.origin else None}

    def load_state_dict(self, state: Any) -> bool:
        """Continue a checkpoint's ramp at this world size: False (and the ramp as this run starts it) when this run
        does not ramp, or the checkpoint holds no ramp state of the kind this writes."""
        if not self.auto or not isinstance(state, dict):
            return False
        batch, recent, changes = state.get("global_batch"), state.get("recent", []), state.get("changes", [])
        if not (isinstance(batch, int) and not isinstance(batch, bool) and batch >= 0 and isinstance(recent, list)
                and all(isinstance(v, float) and v > 0 for v in recent)):
            return False
        try:
            self.changes = [Change(**c) for c in changes]
        except TypeError:  # a list not of this shape: the history is left out, the batch it reached kept
            self.changes = []
        origin = state.get("origin")  # a checkpoint from before it was kept: this run's start is the origin
        if (isinstance(origin, list) and len(origin) == 2 and isinstance(origin[0], int)
                and not isinstance(origin[0], bool) and origin[0] > 0 and isinstance(origin[1], float)
                and 0 < origin[1] < float("inf")):
            self.origin = (origin[0], origin[1])
        self.accum = max(self.start_accum, min(batch, self.max_batch) // self.per_accum)
        self.recent, self.resumed = deque(recent[-SETTLED:], maxlen=SETTLED), True
        self.resume_note = (f"batch ramp at global batch {batch}" if self.global_batch == batch else
                            f"batch ramp at global batch {self.global_batch} (--grad-accum {self.accum}: the nearest "
                            f"this world size makes at or under the checkpoint's {batch})")
        return True

    def plan_line(self, total_samples: int) -> str:
        """The line a ramping run starts with."""
        carried = (f", the rate carried by --ramp-lr {self.lr_rule} from {rate(self.origin[1])} at batch "
                   f"{self.origin[0]}" if self.origin else "")
        return (f"scale-ocr: batch ramp: global batch {self.global_batch}, grown (at most doubling) within "
                f"--ramp-limit {self.limit:g} x B_simple, up to --ramp-max-batch {self.max_batch}{carried}; the run "
                f"is {total_samples} samples long, at whatever batch")

    def summary(self) -> dict[str, Any] | None:
        """metrics.json's ``batch_ramp``: where it started and ended, its limits and each change."""
        if not self.auto:
            return None
        return {"start_batch": self.start_batch, "final_batch": self.global_batch, "limit": self.limit,
                "max_batch": self.max_batch, "lr_rule": self.lr_rule,
                "origin": list(self.origin) if self.origin else None,
                "changes": [asdict(c) for c in self.changes]}
