"""Turn a training checkpoint into a single-file model, and recognise words with it.

``scale-ocr export CKPT OUT.safetensors`` reads a checkpoint written under any strategy and world size
(without starting a process group) and writes the consolidated fp32 weights with the model name,
vocabulary and input size as metadata. ``scale-ocr predict MODEL IMAGE...`` accepts either file kind.
Nothing runs code: a checkpoint's manifest is checked and it is read through :mod:`scale_ocr.safe_dcp`,
exports are safetensors.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from scale_ocr.errors import UserError
from scale_ocr.vocab import Vocab


@dataclass
class LoadedModel:
    """A bare model ready for inference plus what is needed to feed and decode it."""

    model: nn.Module
    arch: str
    vocab: Vocab
    input_size: tuple[int, int]


def _checkpoint_dir(path: Path) -> Path:
    for candidate in (path, path / "checkpoints"):
        latest = candidate / "latest"
        if latest.is_file():
            return candidate / latest.read_text().strip()
    return path


def _build(arch: str, chars: str, input_size: tuple[int, int]) -> tuple[nn.Module, Vocab]:
    from scale_ocr.models import create_model

    vocab = Vocab(chars)
    return create_model(arch, num_classes=vocab.num_classes, input_size=tuple(input_size)), vocab


def load_checkpoint_model(path: Path) -> LoadedModel:
    """The model of a checkpoint folder (``step_N``, a ``checkpoints`` folder or a run directory)."""
    from torch.distributed.checkpoint.api import CheckpointException

    from scale_ocr import safe_dcp
    from scale_ocr.manifest import verify_manifest

    ckpt = _checkpoint_dir(path)
    meta_file = ckpt / "trainer.json"
    if not meta_file.is_file() or not (ckpt / ".metadata").is_file():
        raise UserError(f"{path} holds no complete checkpoint (trainer.json and .metadata expected)")
    listed = verify_manifest(ckpt)  # before reading anything in it
    try:
        meta = json.loads(meta_file.read_text(encoding="utf-8"))
        model, vocab = _build(meta["arch"], meta["vocab"], meta["input_size"])
    except (ValueError, KeyError, TypeError) as exc:  # older checkpoints have no manifest to catch this earlier
        raise UserError(f"{meta_file} is unreadable ({type(exc).__name__}); the checkpoint is damaged") from None
    state = {"model": model.state_dict()}
    try:
        with warnings.catch_warnings():  # "loading in a single process" is exactly the intent here
            warnings.simplefilter("ignore", UserWarning)
            safe_dcp.load(state, ckpt, listed, no_dist=True)
    except UserError:
        raise
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - damaged or foreign files raise several
        # types; CheckpointException derives from BaseException
        raise UserError(f"checkpoint {ckpt} cannot be read ({type(exc).__name__}); it is damaged or incomplete") from None
    model.load_state_dict(state["model"])
    return LoadedModel(model.eval(), meta["arch"], vocab, tuple(meta["input_size"]))


def load_export(path: Path) -> LoadedModel:
    """A model written by :func:`export`."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
        tensors = load_file(str(path))
    except Exception as exc:  # noqa: BLE001 - truncated or foreign files
        raise UserError(f"{path} is not a readable safetensors export ({type(exc).__name__})") from None
    if "arch" not in meta or "vocab" not in meta:
        raise UserError(f"{path} lacks scale-ocr metadata (arch, vocab); export it with `scale-ocr export`")
    model, vocab = _build(meta["arch"], meta["vocab"], json.loads(meta["input_size"]))
    try:
        model.load_state_dict(tensors)
    except RuntimeError as exc:
        raise UserError(f"{path} does not match {meta['arch']} ({str(exc).splitlines()[0]})") from None
    return LoadedModel(model.eval(), meta["arch"], vocab, tuple(json.loads(meta["input_size"])))


def load_any(path: str | Path) -> LoadedModel:
    p = Path(path)
    if not p.exists():
        raise UserError(f"{p} does not exist; pass a checkpoint folder, a run directory or a .safetensors export")
    return load_export(p) if p.is_file() else load_checkpoint_model(p)


def export(src: str | Path, out: str | Path) -> Path:
    """Write ``src``'s model as consolidated fp32 safetensors with its metadata."""
    from safetensors.torch import save_file

    loaded = load_any(src)
    tensors = {k: v.detach().float().contiguous() if v.is_floating_point() else v.contiguous()
               for k, v in loaded.model.state_dict().items()}
    meta = {"arch": loaded.arch, "vocab": loaded.vocab.chars, "input_size": json.dumps(list(loaded.input_size)),
            "format": "scale-ocr/1"}
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out), metadata=meta)
    return out


@torch.no_grad()
def predict(loaded: LoadedModel, images: list[str], batch_size: int = 64) -> list[tuple[str, str, float]]:
    """``(image, word, confidence)`` for each image, in batches."""
    from PIL import Image, UnidentifiedImageError

    from scale_ocr.data.transforms import build_transform
    from scale_ocr.models.recognition.ctc import ctc_greedy_decode

    tf = build_transform(loaded.input_size, train=False)
    results = []
    for i in range(0, len(images), batch_size):
        chunk = images[i:i + batch_size]
        tensors = []
        for name in chunk:
            try:
                with Image.open(name) as im:
                    tensors.append(tf(im.convert("RGB")))
            except (FileNotFoundError, UnidentifiedImageError, OSError) as exc:
                raise UserError(f"{name} cannot be read as an image ({type(exc).__name__})") from None
        logits = loaded.model(torch.stack(tensors))["logits"]
        words, confs = ctc_greedy_decode(logits, loaded.vocab)
        results += list(zip(chunk, words, confs, strict=True))
    return results
