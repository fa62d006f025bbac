"""Weights in and out in other layouts: ``--init-from`` a state dict file, ``export --format doctr``.

A model that has a docTR twin says so with two methods (a capability, never a name): ``to_doctr_state_dict`` and
``from_doctr_state_dict``. Files are read as tensors only: nothing in them runs.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from scale_ocr.disk import GiB, MiB, open_user_file
from scale_ocr.errors import UserError, shown
from scale_ocr.models.registry import capable

MODEL_FILE_LIMIT = 256 * GiB  # a model file (an export, a run's .pt, --init-from weights) past this is not one


def holds_safetensors(path: str | Path, what: str = "the model file") -> bool:
    """Whether ``path`` is a safetensors file by its content (the header's length in 8 little-endian bytes, then its
    JSON object), whatever its name: an export written as ``OUT.pt`` is read as the export it is, not refused as a
    torch pickle. Opened as every user's file is (:func:`scale_ocr.disk.open_user_file`): a FIFO, a device or a file
    past :data:`MODEL_FILE_LIMIT` is one line."""
    with open_user_file(path, what=what, limit=MODEL_FILE_LIMIT, follow=True) as f:
        head = f.read(9)
    return len(head) == 9 and head[8:] == b"{" and int.from_bytes(head[:8], "little") <= 100 * MiB


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """A flat ``{name: tensor}`` from a ``.pt``/``.pth`` (tensors only) or ``.safetensors`` file, else one line."""
    from scale_ocr.checkpoint.safe_dcp import load_tensors

    p = Path(path)
    if not p.is_file():
        raise UserError(f"--init-from {p} does not exist; pass a state dict file (.pt of tensors or .safetensors)")
    try:
        if p.suffix == ".safetensors" or holds_safetensors(p, "--init-from"):
            from safetensors.torch import load_file

            state = load_file(str(p))
        else:
            state = load_tensors(p)  # a refused global (a crafted pickle) is already one line
    except UserError:
        raise
    except Exception as exc:  # noqa: BLE001 - truncated or foreign files raise several types
        raise UserError(f"--init-from {p} cannot be read ({type(exc).__name__}); it is truncated or not a torch "
                        "state dict") from None
    if isinstance(state, dict) and isinstance(state.get("model"), dict):  # {"model": state_dict, ...} bundles
        state = state["model"]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise UserError(f"--init-from {p} is not a state dict (a mapping of names to tensors)")
    bad = nonfinite_tensors(state)
    if bad:
        raise UserError(f"--init-from {shown(p)}: {len(bad)} of its {len(state)} tensors hold NaN or inf (e.g. "
                        f"{shown(bad[0])}); a model cannot train from them: pass weights saved from a run that did not "
                        "diverge")
    return state


def nonfinite_tensors(state: dict[str, torch.Tensor]) -> list[str]:
    """The names of the floating tensors of ``state`` that hold a NaN or an inf."""
    return [k for k, v in state.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]


def mismatch(model: nn.Module, state: dict[str, torch.Tensor]) -> str | None:
    """What keeps ``state`` from loading into ``model`` strictly, in a few words; None when it loads."""
    own = model.state_dict()
    missing = [k for k in own if k not in state]
    extra = [k for k in state if k not in own]
    shapes = [k for k in own if k in state and tuple(state[k].shape) != tuple(own[k].shape)]
    if not (missing or extra or shapes):
        return None
    parts = []
    if missing:
        parts.append(f"{len(missing)} of the model's tensors missing (e.g. {missing[0]})")
    if extra:
        parts.append(f"{len(extra)} unknown (e.g. {extra[0]})")
    if shapes:
        k = shapes[0]
        parts.append(f"{len(shapes)} of another shape (e.g. {k}: file {list(state[k].shape)}, model "
                     f"{list(own[k].shape)})")
    return ", ".join(parts)


def load_initial_weights(model: nn.Module, path: str | Path, arch: str) -> int:
    """Set every tensor of the whole (unsharded) ``model`` from the file at ``path``, in the model's own layout or,
    for a model with a docTR twin, in docTR's; returns the count. Anything short of an exact match is one line."""
    state = read_state_dict(path)
    problem = mismatch(model, state)
    if problem and capable(model, "from_doctr_state_dict"):
        try:
            translated = model.from_doctr_state_dict(state)
        except (KeyError, ValueError, IndexError):
            translated = None
        if translated is not None and mismatch(model, translated) is None:
            state, problem = translated, None
    if problem:
        raise UserError(f"--init-from {path} does not fit {arch}: {problem}; pass weights of this architecture "
                        "with the same vocabulary size and input size")
    with torch.no_grad():
        model.load_state_dict(state, strict=True)
    return len(state)


StateDict = dict[str, torch.Tensor]


def doctr_layout(model: nn.Module, arch: str) -> tuple[str, Callable[[StateDict], StateDict]]:
    """``(docTR architecture, a function that puts a state dict, or any part of one, in docTR's layout)`` for a model
    (built or on the meta device), or one line when it has no docTR twin."""
    from scale_ocr.models.registry import PREFIX

    if arch.startswith(PREFIX):
        return arch[len(PREFIX):], lambda state: state
    if capable(model, "to_doctr_state_dict"):
        return model.to_doctr_state_dict({})[0], lambda state: model.to_doctr_state_dict(state)[1]
    raise UserError(f"{arch} has no docTR counterpart to export to (scale_ocr's CRNNs and DBNets and docTR's own "
                    "doctr: models have; scale_ocr's ViTSTRs are CTC models, docTR's decode tokens); export it as "
                    ".safetensors (the default format)")


def doctr_state_dict(model: nn.Module, arch: str) -> tuple[str, dict[str, torch.Tensor]]:
    """``(docTR architecture, state dict in docTR's layout)`` of a bare model, fp32, or one line when it has no
    docTR twin."""
    doctr_arch, to_doctr = doctr_layout(model, arch)
    state = {k: v.detach().float() if v.is_floating_point() else v.detach() for k, v in model.state_dict().items()}
    return doctr_arch, to_doctr({k: v.contiguous() for k, v in state.items()})
