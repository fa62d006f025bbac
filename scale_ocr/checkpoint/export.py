"""Turn a training checkpoint into a single-file model, and predict with it.

``scale-ocr export CKPT OUT.safetensors`` reads a checkpoint written under any strategy and world size
(without starting a process group) and writes the consolidated fp32 weights with the model's identity
(name, input size, and what its task records, such as the vocabulary) as metadata. ``scale-ocr predict
MODEL IMAGE...`` accepts either file kind; the model's task says what a prediction is.
Nothing runs code: a checkpoint's manifest is checked and it is read through :mod:`scale_ocr.checkpoint.safe_dcp`,
exports are safetensors.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from scale_ocr.checkpoint.identity import build_checked, dcp_model_elements, safetensors_elements, tensors_elements
from scale_ocr.checkpoint.pointer import checkpoint_folder
from scale_ocr.config import MODEL_SIZE_FIELDS
from scale_ocr.errors import UserError
from scale_ocr.tasks import Task


@dataclass
class LoadedModel:
    """A bare model ready for inference, and its task (which feeds and decodes it)."""

    model: nn.Module
    task: Task
    source: str | None = None  # the file or folder it came from, for messages

    @property
    def arch(self) -> str:
        return self.task.arch


def load_checkpoint_model(path: Path) -> LoadedModel:
    """The model of a checkpoint folder (``step_N``, a ``checkpoints`` folder or a run directory)."""
    from torch.distributed.checkpoint.api import CheckpointException

    from scale_ocr.checkpoint import safe_dcp
    from scale_ocr.checkpoint.manifest import verify_manifest

    ckpt = checkpoint_folder(path)
    meta_file = ckpt / "trainer.json"
    if not meta_file.is_file() or not (ckpt / ".metadata").is_file():
        raise UserError(f"{path} holds no complete checkpoint (trainer.json and .metadata expected)")
    listed = verify_manifest(ckpt)  # before reading anything in it
    try:
        meta = json.loads(meta_file.read_text(encoding="utf-8"))
        # The identity is checked against the registry and the checkpoint's own tensor shapes before a build.
        held = dcp_model_elements(safe_dcp.read_metadata_file(ckpt / ".metadata"))
        model, task = build_checked(meta, held, ckpt, meta_file)
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
    return LoadedModel(model.eval(), task, str(path))


def load_export(path: Path) -> LoadedModel:
    """A model written by :func:`export`."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            held = safetensors_elements(f)  # from the header: what the claimed model must hold
        tensors = load_file(str(path))
    except Exception as exc:  # noqa: BLE001 - truncated or foreign files
        raise UserError(f"{path} is not a readable safetensors export ({type(exc).__name__})") from None
    try:
        identity = (json.loads(meta["identity"]) if "identity" in meta  # scale-ocr/1 exports: recognition only
                    else {"arch": meta["arch"], "vocab": meta["vocab"], "input_size": json.loads(meta["input_size"])})
        model, task = build_checked(identity, held, path, path)
    except (KeyError, ValueError, TypeError):
        raise UserError(f"{path} lacks scale-ocr metadata (the model's identity); export it with "
                        "`scale-ocr export`") from None
    return _with_weights(model, task, tensors, path)


def _with_weights(model: nn.Module, task: Task, state: dict, path: Path) -> LoadedModel:
    """``model`` holding ``state`` (from the file ``path``), ready for inference."""
    try:
        model.load_state_dict(state)
    except RuntimeError as exc:
        raise UserError(f"{path} does not match {task.arch} ({str(exc).splitlines()[0]})") from None
    return LoadedModel(model.eval(), task, str(path))


def load_run_weights(path: Path) -> LoadedModel:
    """A run's ``best_model.pt`` or ``last_model.pt``: a plain state dict, its identity from the run's config.json.

    Read with ``torch.load(weights_only=True)``: tensors and plain containers only, never code.
    """
    from scale_ocr.checkpoint.safe_dcp import load_tensors

    config_file = path.parent / "config.json"
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
        # config.json records the task's own identity keys (the recognizer's vocabulary's characters) at its
        # top level, and the architecture, input size and size overrides in its model section.
        section = config["model"]
        identity = {**config, "arch": section["arch"], "input_size": section["input_size"],
                    **{k: section[k] for k in MODEL_SIZE_FIELDS if section.get(k) is not None}}
    except FileNotFoundError:
        raise UserError(f"{path} has no config.json beside it to say which model it holds; pass the run's "
                        "checkpoint folder or a `scale-ocr export` file") from None
    except (ValueError, KeyError, TypeError):
        raise UserError(f"{config_file} does not describe a model (model.arch, model.input_size); "
                        "the run directory is damaged") from None
    try:
        state = load_tensors(path)  # a refused global (a crafted file) is already one line
    except UserError:
        raise
    except Exception as exc:  # noqa: BLE001 - truncated or foreign files raise several types
        raise UserError(f"{path} cannot be read ({type(exc).__name__}); it is truncated or not a torch file") from None
    if not isinstance(state, dict):
        raise UserError(f"{path} is not a state dict written by scale-ocr")
    try:  # config.json is checked against the registry and the weights' shapes before a build
        model, task = build_checked(identity, tensors_elements(state), path, config_file)
    except (ValueError, KeyError, TypeError):
        raise UserError(f"{config_file} does not describe a model (model.arch, model.input_size); "
                        "the run directory is damaged") from None
    return _with_weights(model, task, state, path)


def load_any(path: str | Path) -> LoadedModel:
    """A checkpoint folder or run directory, a ``.safetensors`` export, or a run's ``best_model.pt``/``last_model.pt``."""
    p = Path(path)
    if not p.exists():
        raise UserError(f"{p} does not exist; pass a checkpoint folder, a run directory, a .safetensors export "
                        "or a run's best_model.pt")
    if p.is_dir():
        return load_checkpoint_model(p)
    return load_run_weights(p) if p.suffix == ".pt" else load_export(p)


def save_export(model: nn.Module, task: Task, out: str | Path) -> Path:
    """Write ``model`` as consolidated fp32 safetensors with ``task``'s identity as metadata (``scale-ocr/2``)."""
    from safetensors.torch import save

    from scale_ocr.models.weights_io import fp32_state_dict
    from scale_ocr.run.safe_files import write_atomic

    tensors = fp32_state_dict(model)
    identity = task.identity()
    # Each identity field also as its own string entry, for readers that do not parse JSON.
    meta = {**{k: v if isinstance(v, str) else json.dumps(v) for k, v in identity.items()},
            "identity": json.dumps(identity), "format": "scale-ocr/2"}
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # Whole or not at all (a temp file renamed over OUT), never through a link; a full disk is one line.
    # The serialised bytes are held in memory once: OCR models are small next to the host's memory.
    data = save(tensors, metadata=meta)
    kept = "the model it was exported from is untouched" + (f" and the previous {out.name} is kept" if out.exists() else "")
    write_atomic(out, data, what="the export", needed=len(data), kept=kept)
    return out


FORMATS = ("safetensors", "doctr")


def export(src: str | Path, out: str | Path, fmt: str = "safetensors") -> Path:
    """Write ``src``'s model as consolidated fp32 safetensors with its metadata, or (``doctr``) as the plain state
    dict docTR's own class of the architecture loads with ``strict=True``, with ``OUT.json`` beside it saying how
    to build that class (architecture, vocabulary, input shape, normalisation)."""
    if fmt not in FORMATS:
        raise UserError(f"--format {fmt}: choose one of {', '.join(FORMATS)}")
    loaded = load_any(src)
    if fmt == "doctr":
        from scale_ocr.models.weights_io import save_doctr

        return save_doctr(loaded.model, loaded.arch, loaded.task.doctr_info(), out)[0]
    return save_export(loaded.model, loaded.task, out)


@torch.no_grad()
def predict(loaded: LoadedModel, images: list[str], batch_size: int = 64) -> list[dict]:
    """The task's prediction for each image file, in batches."""
    return loaded.task.predict(loaded.model, images, batch_size)
