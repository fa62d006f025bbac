"""A model file's claimed identity, checked against the registry and the weights the file holds, before a build.

Built as claimed, a crafted 1 KB ``config.json`` could make ``predict`` allocate gigabytes. So the architecture
must be registered and its sizes in bounds, and the claimed model, built on the meta device, must hold as many
elements as the file; only then is it built for real.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from scale_ocr.config import MODEL_SIZE_FIELDS
from scale_ocr.errors import UserError
from scale_ocr.models.factory import model_entry
from scale_ocr.tasks import Task, task_from_identity

NOT_OURS = "the file is damaged or was not written by scale-ocr for these weights"


def describe(identity: dict[str, Any]) -> str:
    """``vitstr_tiny 32x128, width 192, depth 12``: what an identity claims, as a message names it."""
    h, w = identity["input_size"]
    sizes = [f"{kw} {identity[name]}" for name, kw in MODEL_SIZE_FIELDS.items() if identity.get(name) is not None]
    return ", ".join([f"{identity['arch']} {h}x{w}", *sizes])


def check_claim(identity: dict[str, Any], claimed_in: str) -> None:
    """Refuse an identity whose architecture is not registered or whose sizes are outside the registry's bounds;
    ``claimed_in`` names the file that records it."""
    arch = identity.get("arch") if isinstance(identity, dict) else None
    if not isinstance(arch, str):
        raise UserError(f"{claimed_in} records no model architecture (arch); {NOT_OURS}")
    try:
        entry = model_entry(arch)
    except UserError:
        shown = repr(arch) if len(arch) <= 60 else repr(arch[:60]) + "…"
        raise UserError(f"{claimed_in} claims the model {shown}, which is not registered (see `scale-ocr models`); "
                        f"{NOT_OURS}") from None
    sides = identity.get("input_size")
    if not isinstance(sides, (list, tuple)) or len(sides) != 2:
        raise UserError(f"{claimed_in} records no input size as [height, width] for {arch}; {NOT_OURS}")
    problems = [entry.size_problem("input_side", side) for side in sides]
    problems += [entry.size_problem(kw, identity[name]) for name, kw in MODEL_SIZE_FIELDS.items()
                 if identity.get(name) is not None]
    problem = next((p for p in problems if p), None)
    if problem:
        raise UserError(f"{claimed_in} claims {arch} with {problem}; {NOT_OURS}")


def state_elements(model: nn.Module) -> tuple[int, int]:
    """``(elements, tensors)`` of ``model``'s state dict (parameters and buffers, as every model file holds)."""
    state = model.state_dict()
    return sum(t.numel() for t in state.values()), len(state)


def implied_elements(task: Task) -> int | None:
    """The elements of the state dict of ``task``'s model, built on the meta device (no memory); None for a model
    that cannot be built there (docTR's ``viptr_tiny`` reads a tensor's value in its constructor)."""
    try:
        with torch.device("meta"):
            model = task.create_model()
    except UserError:
        raise
    except (RuntimeError, NotImplementedError):  # "cannot be called on meta tensors": built for real and counted
        return None
    return state_elements(model)[0]


def build_checked(identity: dict[str, Any], held: tuple[int, int], path: str | Path,
                  claimed_in: str | Path, *, layout_only: bool = False) -> tuple[nn.Module, Task]:
    """The model ``identity`` describes, built only once its claim is in bounds and matches what the file holds.

    ``held``: ``(elements, tensors)`` of the model weights in the file ``path``; ``claimed_in``: the file the identity
    was read from. ``layout_only``: the model on the meta device, built for real only when it cannot be built there
    (docTR's viptr_tiny, a small model).
    """
    check_claim(identity, str(claimed_in))
    task = task_from_identity(identity)
    implied = implied_elements(task)
    model = None
    if implied is None:  # bounded by check_claim, so a real build is safe; compared before any weight is loaded
        model = task.build_model()
        implied = state_elements(model)[0]
    if implied != held[0]:
        where = "its metadata" if Path(claimed_in) == Path(path) else str(claimed_in)
        raise UserError(f"{path}: {where} claims {describe(identity)}, a model of {implied:,} weights, but the file "
                        f"holds {held[0]:,} in {held[1]} tensors; {NOT_OURS}")
    if model is not None:
        return model, task
    if layout_only:
        with torch.device("meta"):
            return task.create_model(), task
    return task.build_model(), task


def safetensors_elements(handle: Any) -> tuple[int, int]:
    """``(elements, tensors)`` in an open safetensors file, from its header (no tensor is read)."""
    import math

    keys = list(handle.keys())
    return sum(math.prod(handle.get_slice(k).get_shape()) for k in keys), len(keys)


def dcp_model_elements(metadata: Any) -> tuple[int, int]:
    """``(elements, tensors)`` of the ``model`` entries of a DCP checkpoint's ``.metadata`` (global shapes)."""
    import math

    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    sizes = [math.prod(md.size) for key, md in metadata.state_dict_metadata.items()
             if key.startswith("model.") and isinstance(md, TensorStorageMetadata)]
    return sum(sizes), len(sizes)


def tensors_elements(state: dict[str, Any]) -> tuple[int, int]:
    """``(elements, tensors)`` of a loaded state dict (entries that are not tensors count as none)."""
    tensors = [v for v in state.values() if isinstance(v, torch.Tensor)]
    return sum(t.numel() for t in tensors), len(tensors)
