"""Optimizer specification and learning-rate schedules that work with every engine's optimizer."""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from scale_ocr.config import OptimConfig
from scale_ocr.errors import UserError
from scale_ocr.models.init import full_shape

_OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam}
WARMUP_SHARE = 0.05  # of the run: cosine's warm-up at the reference batch
MAX_WARMUP_SHARE = 0.5  # a warm-up grown with the rate never takes more than this share of the run


def lamb_class() -> type[torch.optim.Optimizer]:
    """timm's LAMB (a pure-PyTorch port of NVIDIA's FusedLAMB; any device, no compiled op), imported on first use:
    importing timm costs about a second, which runs without LAMB do not pay."""
    try:
        from timm.optim.lamb import Lamb
    except ImportError as err:
        raise UserError(f"--optim lamb needs timm's LAMB ({err}); pip install 'timm>=1.0' (scale-ocr's own install "
                        "has it), or pick adamw") from None
    return Lamb


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Two groups: matrices and kernels get weight decay; biases and norm scales (1-D) do not."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if len(full_shape(p)) >= 2 else no_decay).append(p)  # a ZeRO-3 stand-in is 1-D and empty
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]  # an empty group would not survive a checkpoint's round trip


@dataclass(frozen=True)
class OptimizerSpec:
    """How to build the optimizer, for strategies that must build it themselves (after sharding,
    or as fairscale's OSS wrapper around a base class).

    Attributes:
        cls: the torch optimizer class.
        kwargs: its constructor arguments (``lr``, ``betas``, ``weight_decay``).
        layerwise: its update of a tensor depends on that whole tensor's norms (LAMB's trust ratio), so an engine
            that hands it flattened partitions (DeepSpeed's ZeRO and 16-bit optimizers) would change its maths.
    """

    cls: type[torch.optim.Optimizer]
    kwargs: dict[str, Any] = field(default_factory=dict)
    layerwise: bool = False

    def groups(self, model: nn.Module) -> list[dict[str, Any]]:
        return param_groups(model, self.kwargs.get("weight_decay", 0.0))

    def options(self, groups: list[dict[str, Any]]) -> dict[str, Any]:
        """Constructor arguments for the parameters of ``groups``: ``kwargs``, plus ``fused=True`` where torch has a
        fused kernel for them. Torch's default on CPU is a Python loop over the parameters: measured on one core, an
        AdamW step over
        crnn_mobilenet_v3_small's 156 tensors took 11.9 ms that way, 11.2 ms with ``foreach`` and 3.0 ms fused."""
        kwargs = dict(self.kwargs)
        if ("fused" in inspect.signature(self.cls).parameters and not {"fused", "foreach"} & kwargs.keys()
                and fused_supported(p for g in groups for p in g["params"])):
            kwargs["fused"] = True
        return kwargs

    def build(self, model: nn.Module) -> torch.optim.Optimizer:
        groups = self.groups(model)
        return self.cls(groups, **self.options(groups))


def fused_supported(params: Iterable[torch.Tensor]) -> bool:
    """Every parameter is floating point and all are on one device type torch has fused optimizer kernels for."""
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
    except ImportError:  # a torch without the helper: keep its default
        return False
    params = list(params)
    devices = {p.device.type for p in params}
    return (len(devices) == 1 and devices <= set(_get_fused_kernels_supported_devices())
            and all(p.is_floating_point() for p in params))


def build_optimizer_spec(cfg: OptimConfig) -> OptimizerSpec:
    """The optimizer named by ``cfg.optim`` with the run's learning rate and weight decay (fused where supported).

    LAMB's own global-norm clipping (timm's ``max_grad_norm``) is off: ``--clip-grad`` clips the global norm the same
    way under every engine, where the optimizer's would see only a rank's shard under FSDP and fairscale."""
    kwargs = {"lr": cfg.peak_lr, "betas": (0.9, 0.999), "weight_decay": cfg.wd}
    if cfg.optim == "lamb":
        return OptimizerSpec(lamb_class(), {**kwargs, "max_grad_norm": None}, layerwise=True)
    return OptimizerSpec(_OPTIMIZERS[cfg.optim], kwargs)


def scale_factor(rule: str, global_batch: int, reference_batch: int | None) -> float:
    """How much ``rule`` multiplies a rate tuned at ``reference_batch`` for ``global_batch``.

    ``linear``: G/R (Goyal et al. 2017, for SGD: the same step per sample); ``sqrt``: sqrt(G/R) (Adam-style
    optimizers: Malladi et al. 2022 derive it from the SDE their updates follow; Hoffer et al. 2017); ``none``: 1.
    """
    if rule == "none" or reference_batch is None:
        return 1.0
    ratio = global_batch / reference_batch
    return ratio if rule == "linear" else math.sqrt(ratio)


def rate(x: float) -> str:
    """A rate as people write it: ``2.4e-3``."""
    mantissa, exponent = f"{x:.2e}".split("e")
    return f"{float(mantissa):g}e{int(exponent)}"


@dataclass(frozen=True)
class LRPlan:
    """The run's peak rate and how it came about (``config.json``'s ``lr_plan``, the log's first line).

    Attributes:
        base_lr: the rate before scaling: the model's recommended one, or ``--lr``.
        rule: ``none``, ``linear`` or ``sqrt`` (:func:`scale_factor`).
        reference_batch: the global batch ``base_lr`` is stated at (None: used as given).
        global_batch: this run's ranks x micro-batch x accumulation.
    """

    base_lr: float
    rule: str
    reference_batch: int | None
    global_batch: int

    @property
    def factor(self) -> float:
        return scale_factor(self.rule, self.global_batch, self.reference_batch)

    @property
    def peak_lr(self) -> float:
        return self.base_lr * self.factor

    def describe(self) -> str:
        """``lr 2.4e-3 = 1.2e-3 x 2 (linear: global batch 128 / reference 64)``, or the rate unscaled (rule none)."""
        if self.reference_batch is None:
            return f"lr {rate(self.peak_lr)} unscaled (--lr-scaling none; global batch {self.global_batch})"
        return (f"lr {rate(self.peak_lr)} = {rate(self.base_lr)} x {self.factor:.3g} ({self.rule}: global batch "
                f"{self.global_batch} / reference {self.reference_batch})")

    def record(self, warmup_steps: int | None = None) -> dict[str, Any]:
        return {"peak_lr": self.peak_lr, "base_lr": self.base_lr, "factor": self.factor, "rule": self.rule,
                "reference_batch": self.reference_batch, "global_batch": self.global_batch,
                "warmup_steps": warmup_steps, "line": self.describe()}


def plan_lr(cfg: OptimConfig, global_batch: int) -> LRPlan:
    """The peak rate of a run of ``global_batch`` from a resolved optim section (:func:`scale_ocr.run.resolve.resolve`
    filled in the rate, its reference batch and the rule)."""
    return LRPlan(cfg.peak_lr, cfg.lr_scaling or "none", cfg.lr_reference_batch, global_batch)


def lr_factor(sched: str, total_steps: int, warmup_steps: int) -> Callable[[float], float]:
    """Multiplier of the peak learning rate at optimizer step ``s`` (0-based; a fraction where the batch grew)."""
    total = max(1, total_steps)

    def cosine(s: float) -> float:
        if s < warmup_steps:
            return (s + 1) / (warmup_steps + 1)
        progress = min(1.0, (s - warmup_steps) / max(1, total - warmup_steps))
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    def onecycle(s: float) -> float:
        # torch's OneCycleLR defaults: 30% rise from lr/25, then anneal to lr/(25*1e4), cosine shaped.
        up = max(1, int(0.3 * total))
        start, end = 1 / 25, 1 / (25 * 1e4)
        if s < up:
            return start + (1 - start) * 0.5 * (1 - math.cos(math.pi * s / up))
        progress = min(1.0, (s - up) / max(1, total - up))
        return end + (1 - end) * 0.5 * (1 + math.cos(math.pi * progress))

    def constant(s: float) -> float:
        return min(1.0, (s + 1) / (warmup_steps + 1)) if warmup_steps else 1.0

    return {"cosine": cosine, "onecycle": onecycle, "constant": constant}[sched]


class LRSchedule:
    """Sets ``lr`` on an optimizer's param groups for each optimizer step.

    It writes ``param_groups`` directly instead of using ``torch.optim.lr_scheduler``: DeepSpeed's
    ZeRO optimizers and fairscale's OSS expose torch-compatible ``param_groups`` but are not all
    ``torch.optim.Optimizer`` instances, and this one mechanism serves every strategy.

    The schedule advances in samples: ``factor`` is read at the samples trained so far over ``plan``'s global batch
    (the run's starting one), which is the step count while the batch stays as it started, and keeps the schedule's
    shape over the run's samples when ``--batch-ramp`` grows the batch (:meth:`set_plan` then moves the peak rate).
    """

    def __init__(self, optimizer: Any, peak_lr: float, factor: Callable[[float], float], on_resume: str = "keep",
                 plan: LRPlan | None = None) -> None:
        self.optimizer, self.peak_lr, self.factor = optimizer, peak_lr, factor
        self.on_resume, self.plan = on_resume, plan or LRPlan(peak_lr, "none", None, 0)
        self.line = self.plan.describe() if plan else f"lr {rate(peak_lr)}"
        self.base_batch = max(1, self.plan.global_batch)  # samples per unit of the schedule's position
        self.step_count = 0
        self.samples = 0  # trained so far: the schedule's position is samples / base_batch
        self.resume_note = ""  # after load_state_dict: which peak rate a resumed run took, and why
        self._apply()

    def _apply(self) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr

    @property
    def lr(self) -> float:
        return self.peak_lr * self.factor(self.samples / self.base_batch)

    def step(self, samples: int | None = None) -> None:
        """One optimizer step of ``samples`` (default: the starting global batch) is done."""
        self.step_count += 1
        self.samples += self.base_batch if samples is None else samples
        self._apply()

    def set_plan(self, plan: LRPlan) -> None:
        """Train at ``plan``'s peak rate from the next step on (the global batch changed; the rule carried it)."""
        self.plan, self.peak_lr, self.line = plan, plan.peak_lr, plan.describe()
        self._apply()

    def state_dict(self) -> dict[str, Any]:
        return {"step_count": self.step_count, "samples": self.samples, "peak_lr": self.peak_lr,
                "recipe": self._recipe(), "line": self.line}

    def _recipe(self) -> list[Any]:
        """What the rate was derived from, less the global batch: a resume that changes it changes the rate."""
        return [self.plan.base_lr, self.plan.rule, self.plan.reference_batch]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue at ``state``'s step (and samples; without them, the step's worth at the starting batch) and at
        :meth:`resumed_peak`'s rate; ``resume_note`` says which."""
        self.step_count = int(state["step_count"])
        samples = state.get("samples")
        self.samples = (samples if isinstance(samples, int) and not isinstance(samples, bool) and samples >= 0
                        else self.step_count * self.base_batch)
        self.peak_lr, self.resume_note = self.resumed_peak(state)
        self._apply()

    def resumed_peak(self, state: dict[str, Any]) -> tuple[float, str]:
        """The peak rate a run resumed from ``state`` trains at, and a phrase saying why.

        A rate that differs only because the global batch did (another world size, micro-batch or accumulation, same
        flags) is the checkpoint's under ``keep``, so a resume does not jump the rate mid-run (Lightning restores
        the scheduler's base rate too), this run's under ``rescale``. A rate the flags changed (``--lr``,
        ``--lr-scaling``...) is this run's."""
        own, saved = self.plan.peak_lr, state.get("peak_lr")
        if isinstance(saved, bool) or not isinstance(saved, (int, float)) or not 0 < saved < math.inf:
            # a checkpoint from before rates were recorded (or a damaged trainer.json): this run's, and it says so
            return own, f"{self.line} (the checkpoint records no rate)"
        if math.isclose(saved, own, rel_tol=1e-9):
            return own, f"lr {rate(saved)} as before"
        if state.get("recipe") != self._recipe():
            return own, f"{self.line}, as this run's flags set it (the run it continues trained at {rate(saved)})"
        if self.on_resume == "keep":
            return float(saved), (f"lr kept at {rate(saved)}, the rate of the run it continues (this run alone would "
                                   f"train at {self.line}; --lr-on-resume rescale for that)")
        return own, f"lr rescaled (--lr-on-resume rescale): {self.line}, was {rate(saved)}"


def default_warmup(cfg: OptimConfig, total_steps: int, factor: float = 1.0) -> int:
    """Warm-up steps: ``--warmup-steps`` as given; else 5% of the run for cosine and none for constant, grown with
    a rate that scaling raised.

    Goyal et al. (2017) reach a k-times rate through a gradual warm-up, without which the first steps of large
    batches diverge; the higher the rate, the longer the climb. So for a factor k > 1 the warm-up is k x 5% of the
    run (cosine and constant alike), at most :data:`MAX_WARMUP_SHARE` of it. onecycle's 30% rise from lr/25 is its
    warm-up and does not change.
    """
    if cfg.warmup_steps is not None:
        return cfg.warmup_steps
    if cfg.sched == "onecycle" or (cfg.sched != "cosine" and factor <= 1):
        return 0
    return int(min(MAX_WARMUP_SHARE, WARMUP_SHARE * max(1.0, factor)) * total_steps)
