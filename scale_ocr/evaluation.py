"""Validation: sharded over ranks, every rank runs the same batches, sums are all-reduced."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.data import DataLoader

from scale_ocr.distributed import all_reduce_sum
from scale_ocr.metrics import TextMetric
from scale_ocr.models.recognition.ctc import ctc_greedy_decode, ctc_loss
from scale_ocr.vocab import Vocab


@dataclass
class EvalResult:
    """Validation metrics plus a few examples from rank 0 (images, targets, predictions)."""

    metrics: dict[str, float]
    examples: list[tuple[torch.Tensor, str, str]] = field(default_factory=list)


@torch.no_grad()
def evaluate(model: nn.Module, loader: DataLoader, vocab: Vocab, device: torch.device,
             autocast: Callable[[], AbstractContextManager], num_examples: int = 8) -> EvalResult:
    """Loss, exact match, case-insensitive match and CER over the whole validation set.

    The forward goes through the wrapped model on every rank (sharded engines gather parameters
    inside it), and padding items added to even out the shards are masked out of every sum.
    """
    model.eval()
    metric = TextMetric()
    loss_sum, examples = 0.0, []
    for batch in loader:
        batch = batch.to(device)
        with autocast():
            logits = model(batch.images)["logits"]
        losses = ctc_loss(logits, batch.targets, batch.target_lengths, reduction="none")
        valid = batch.valid.to(losses.device)
        loss_sum += float(losses[valid].sum())
        preds, _ = ctc_greedy_decode(logits, vocab)
        keep = [i for i, v in enumerate(batch.valid.tolist()) if v]
        metric.update([preds[i] for i in keep], [batch.words[i] for i in keep])
        for i in keep[: max(0, num_examples - len(examples))]:
            examples.append((batch.images[i].cpu(), batch.words[i], preds[i]))
    model.train()
    sums = all_reduce_sum([loss_sum, *metric.sums()], device)
    rates = TextMetric.rates(sums[1:])
    return EvalResult({"val_loss": sums[0] / max(sums[-1], 1), **rates}, examples)
