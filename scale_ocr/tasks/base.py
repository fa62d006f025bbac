"""What a task is: everything that differs between recognising words and detecting them.

A task owns its data format and synthetic generator, its batch layout, the model family (the registry
entry names its task), how a model is evaluated and which metrics come out, and what a prediction looks
like. The trainer, checkpoints, ``verify``, the benchmark runner, the memory model and W&B call a task's
methods and never ask which task it is, exactly as they never ask which strategy runs.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from scale_ocr.config import MODEL_IDENTITY_FIELDS, MODEL_SIZE_FIELDS, DataConfig, ModelConfig
from scale_ocr.distributed.process_group import DistInfo
from scale_ocr.errors import UserError
from scale_ocr.models.factory import create_model, list_models, model_entry, model_vocabs
from scale_ocr.models.init import ModelFactory
from scale_ocr.models.registry import capable
from scale_ocr.vocab import resolve_vocab


@dataclass
class EvalResult:
    """Validation metrics (already reduced over ranks) and a few rank-0 examples for the W&B table.

    ``examples`` are rows of a table: column name -> value, where an (H, W, 3) uint8 array is an image.
    """

    metrics: dict[str, float]
    examples: list[dict[str, Any]] = field(default_factory=list)


class Task(ABC):
    """One kind of OCR model. Subclasses are registered by name in :mod:`scale_ocr.tasks`.

    Args:
        model_cfg: the model section (architecture, input size, and whatever the task reads from it).
    """

    name: ClassVar[str]
    default_input_size: ClassVar[tuple[int, int]]
    default_samples: ClassVar[tuple[int, int]]  # synthetic (train, validation) samples unless the user says
    default_augment: ClassVar[bool]  # train-time augmentation unless the user says (--augment / --no-augment)
    moves_text: ClassVar[bool]  # its images may be turned and distorted (--degrade rotate): no box to leave
    reads_own_width: ClassVar[bool] = False  # its models read crops at their own width (--max-width)
    default_sched: ClassVar[str] = "cosine"  # learning-rate schedule unless the user says (--sched)
    # Summary metrics, in the order printed; the first is the one "best" checkpoints maximise.
    metric_names: ClassVar[tuple[str, ...]]
    percent_metrics: ClassVar[frozenset[str]] = frozenset()  # printed as percentages

    def __init__(self, model_cfg: ModelConfig) -> None:
        check_size_overrides(model_cfg)
        self.cfg = model_cfg
        self.arch = model_cfg.arch
        self.input_size = tuple(model_cfg.input_size or self.default_input_size)
        names, default = model_vocabs(self.arch)  # the model's own named vocabularies (docTR's for its models)
        self.charset = resolve_vocab(model_cfg.vocab or default, model_cfg.vocab_file, names)

    @classmethod
    def resolve_page_scale(cls, cfg) -> tuple[str | None, int | None]:
        """``(page scale, longest page side)`` of the run (``--page-scale``, ``--max-page-side``): the tasks that read
        pages override it; the others refuse either flag in one line."""
        if cfg.model.page_scale is not None or cfg.model.max_page_side is not None:
            raise UserError(f"--page-scale and --max-page-side set how a detector reads pages; {cfg.model.arch} "
                            "reads word crops (--input-size): drop them")
        return None, None

    @classmethod
    def check_config(cls, cfg) -> None:
        """Refuse a :class:`~scale_ocr.config.RunConfig` this task cannot train, with one line (UserError)."""
        return None  # most tasks accept every config

    @abstractmethod
    def model_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of the registry builder for this run."""

    def build_model(self) -> nn.Module:
        """The model of this run: the registry's architecture with this run's options applied."""
        return self.model_factory().build()

    def model_factory(self, load_weights: Callable[[nn.Module], str] | None = None) -> ModelFactory:
        """How a strategy builds this run's model: the bare architecture and its options; ``load_weights`` (the
        launch script's ``--init-from`` loader) fills the built model."""
        return ModelFactory(self.create_model, self.apply_options, load_weights)

    def create_model(self) -> nn.Module:
        """The bare architecture at this run's size (an engine may build it inside its own context)."""
        return create_model(self.arch, **self.model_kwargs(), **self.cfg.size_overrides())

    def apply_options(self, model: nn.Module) -> nn.Module:
        """Wrap a bare model as this run asks (activation checkpointing, channels-last images); parameter names do
        not change."""
        if self.cfg.channels_last and capable(model, "channels_last"):
            model.register_forward_pre_hook(channels_last_images)
        if self.cfg.activation_checkpointing:
            from scale_ocr.models.checkpointing import apply_activation_checkpointing

            apply_activation_checkpointing(model, self.arch)
        return model

    @abstractmethod
    def dummy_inputs(self, batch: int) -> tuple[torch.Tensor, ...]:
        """A training batch's model arguments with random images (memory and FLOP measurements). A task whose models
        read their own width also takes ``width=``: images that wide."""

    def input_width(self, batch) -> int | None:
        """The width a training batch's inputs are padded to, where the task's models read their own width (MFU
        bills the batch at it); None: every batch is of the task's input size."""
        return None

    @abstractmethod
    def build_data(self, cfg: DataConfig, batch_size: int, seed: int, dist: DistInfo):
        """Train and validation loaders for this rank (a :class:`~scale_ocr.data.loader.Data`)."""

    @abstractmethod
    def eval_set(self, paths: tuple[str, ...], on_bad_sample: str = "error") -> tuple[Dataset, Callable]:
        """Labelled samples in folders or a shard set to measure on, and the collate :meth:`evaluate`'s batches need
        (validation, ``scale-ocr evaluate``)."""

    @abstractmethod
    def evaluate(self, model: nn.Module, loader: DataLoader, device: torch.device,
                 autocast: Callable[[], AbstractContextManager]) -> EvalResult:
        """Validation loss and metrics over the whole validation set; every rank calls it (it all-reduces)."""

    def identity(self) -> dict[str, Any]:
        """What a checkpoint must match to be resumed or loaded by this task (and what an export records)."""
        return {"arch": self.arch, "input_size": list(self.input_size),
                **{k: getattr(self.cfg, k) for k in MODEL_IDENTITY_FIELDS if getattr(self.cfg, k) is not None}}

    def describe(self) -> dict[str, Any]:
        """Extra facts for the run's config.json."""
        return {"task": self.name}

    def score(self, metrics: dict[str, float]) -> tuple[float, float]:
        """Higher is better: the headline metric, then lower validation loss."""
        return metrics[self.metric_names[0]], -metrics["val_loss"]

    def format_metrics(self, metrics: dict[str, Any]) -> str:
        """``name=value`` for each summary metric (n/a where not measured)."""
        parts = []
        for k in self.metric_names:
            v = metrics.get(k)
            parts.append(f"{k}=n/a" if v is None else f"{k}={v:.2%}" if k in self.percent_metrics else f"{k}={v:.4f}")
        return " ".join(parts)

    @classmethod
    @abstractmethod
    def from_identity(cls, identity: dict[str, Any]) -> Task:
        """The task of a checkpoint or export, from what :meth:`identity` recorded."""

    @staticmethod
    def model_config(identity: dict[str, Any]) -> ModelConfig:
        """The model section an identity describes: architecture, input size and any size overrides."""
        return ModelConfig(arch=identity["arch"], input_size=tuple(identity["input_size"]),
                           **{k: identity[k] for k in MODEL_IDENTITY_FIELDS if identity.get(k) is not None})

def check_size_overrides(model: ModelConfig) -> None:
    """Refuse a size override (``--model-width`` ...) that the model's builder does not take, or a size or input side
    beyond the registry's bounds (:data:`scale_ocr.models.registry.SIZE_BOUNDS`), in one line."""
    entry = model_entry(model.arch)
    for name, kwarg in MODEL_SIZE_FIELDS.items():
        value = getattr(model, name)
        if value is None:
            continue
        if not entry.accepts(kwarg):
            takers = ", ".join(m for m in list_models() if model_entry(m).accepts(kwarg))
            raise UserError(f"--{name.replace('_', '-')}: {model.arch} has no {kwarg} to set; it applies to {takers}")
        if problem := entry.size_problem(kwarg, value):
            raise UserError(f"--{name.replace('_', '-')}: {problem}")
    for side in model.input_size or ():
        if problem := entry.size_problem("input_side", side):
            raise UserError(f"--input-size: {problem}")


def channels_last_images(module: nn.Module, args: tuple) -> tuple:
    """Forward pre-hook: the images (first argument) in channels-last memory order, the rest as given.

    Only the input changes: convolutions follow their input's layout, and the weights keep theirs, which engines
    that flatten parameters (DeepSpeed) could not keep anyway, so every engine computes the same thing.
    """
    if args and isinstance(args[0], torch.Tensor) and args[0].dim() == 4:
        return (args[0].contiguous(memory_format=torch.channels_last), *args[1:])
    return args

