"""Turn a training checkpoint into a single-file model, and predict with it (docs/checkpoints.md).

A checkpoint of any strategy and world size is read without a process group, one tensor at a time
(:func:`open_weights`); nothing runs code: manifests are checked, DCP goes through :mod:`.safe_dcp`.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from scale_ocr.checkpoint.identity import build_checked, dcp_model_elements, safetensors_elements, tensors_elements
from scale_ocr.checkpoint.piecewise import SafetensorsFile, TensorSpec, TorchFile, TorchFileReader
from scale_ocr.checkpoint.pointer import checkpoint_folder
from scale_ocr.config import MODEL_IDENTITY_FIELDS
from scale_ocr.disk import atomic_file, check_output, read_user_json, write_atomic
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


def _checkpoint_identity(path: Path) -> tuple[Path, dict, tuple[int, int], set[str] | None]:
    """A checkpoint folder's ``step_N``, its trainer.json, the model elements its .metadata holds and its manifest's
    files (checked before anything is read)."""
    from scale_ocr.checkpoint import safe_dcp
    from scale_ocr.checkpoint.manifest import verify_manifest

    ckpt = checkpoint_folder(path)
    meta_file = ckpt / "trainer.json"
    if not meta_file.is_file() or not (ckpt / ".metadata").is_file():
        raise UserError(f"{path} holds no complete checkpoint (trainer.json and .metadata expected)")
    listed = verify_manifest(ckpt)  # before reading anything in it
    try:
        meta = read_user_json(meta_file, what="the checkpoint's trainer.json", nan_ok=True)
        held = dcp_model_elements(safe_dcp.read_metadata_file(ckpt / ".metadata"))
    except (ValueError, KeyError, TypeError) as exc:  # older checkpoints have no manifest to catch this earlier
        raise UserError(f"{meta_file} is unreadable ({type(exc).__name__}); the checkpoint is damaged") from None
    return ckpt, meta, held, listed


def _damaged(ckpt: Path) -> str:
    return f"{ckpt / 'trainer.json'} is unreadable ({{kind}}); the checkpoint is damaged"


def _checked(identity: dict, held: tuple[int, int], path: Path, claimed_in: Path, damaged: str, *,
             layout_only: bool = False) -> tuple[nn.Module, Task]:
    """:func:`build_checked`, an identity that is not one (missing keys, wrong types) as the one line ``damaged`` (in
    which ``{kind}`` becomes the exception's type)."""
    try:
        return build_checked(identity, held, path, claimed_in, layout_only=layout_only)
    except (ValueError, KeyError, TypeError) as exc:
        raise UserError(damaged.replace("{kind}", type(exc).__name__)) from None


def _read_dcp(ckpt: Path, load: Callable[[], None]) -> None:
    """Run ``load`` (a DCP read of ``ckpt`` in this process alone); a damaged file is one line."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with warnings.catch_warnings():  # "loading in a single process" is exactly the intent here
            warnings.simplefilter("ignore", UserWarning)
            load()
    except UserError:
        raise
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - damaged or foreign files raise several
        # types; CheckpointException derives from BaseException
        raise UserError(f"checkpoint {ckpt} cannot be read ({type(exc).__name__}); it is damaged or "
                        "incomplete") from None


def load_checkpoint_model(path: Path) -> LoadedModel:
    """The model of a checkpoint folder (``step_N``, a ``checkpoints`` folder or a run directory)."""
    from scale_ocr.checkpoint import safe_dcp

    ckpt, meta, held, listed = _checkpoint_identity(path)
    # The identity is checked against the registry and the checkpoint's own tensor shapes before a build.
    model, task = _checked(meta, held, ckpt, ckpt / "trainer.json", _damaged(ckpt))
    state = {"model": model.state_dict()}
    _read_dcp(ckpt, lambda: safe_dcp.load(state, ckpt, listed, no_dist=True))
    model.load_state_dict(state["model"])
    return LoadedModel(model.eval(), task, str(path))


def _export_identity(path: Path, layout_only: bool = True) -> tuple[nn.Module, Task]:
    """An export's model (its layout, or built) and task, checked against what its header holds."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            held = safetensors_elements(f)  # from the header: what the claimed model must hold
    except Exception as exc:  # noqa: BLE001 - truncated or foreign files
        raise UserError(f"{path} is not a readable safetensors export ({type(exc).__name__})") from None
    try:
        identity = (json.loads(meta["identity"]) if "identity" in meta  # scale-ocr/1 exports: recognition only
                    else {"arch": meta["arch"], "vocab": meta["vocab"], "input_size": json.loads(meta["input_size"])})
    except (KeyError, ValueError, TypeError):
        identity = None
    damaged = (f"{path} lacks scale-ocr metadata (the model's identity); export it with `scale-ocr export`")
    if identity is None:
        raise UserError(damaged)
    return _checked(identity, held, path, path, damaged, layout_only=layout_only)


def load_export(path: Path) -> LoadedModel:
    """A model written by :func:`export`."""
    from safetensors.torch import load_file

    model, task = _export_identity(path, layout_only=False)
    try:
        tensors = load_file(str(path))
    except Exception as exc:  # noqa: BLE001 - truncated or foreign files
        raise UserError(f"{path} is not a readable safetensors export ({type(exc).__name__})") from None
    return _with_weights(model, task, tensors, path)


def _with_weights(model: nn.Module, task: Task, state: dict, path: Path) -> LoadedModel:
    """``model`` holding ``state`` (from the file ``path``), ready for inference."""
    try:
        model.load_state_dict(state)
    except RuntimeError as exc:
        raise UserError(f"{path} does not match {task.arch} ({str(exc).splitlines()[0]})") from None
    return LoadedModel(model.eval(), task, str(path))


def _run_weights(path: Path, *, layout_only: bool) -> tuple[nn.Module, Task, dict]:
    """A run's ``best_model.pt`` or ``last_model.pt`` (read with ``weights_only=True``), its identity from the run's
    config.json; ``layout_only``: tensors on the meta device, the model as its layout."""
    from scale_ocr.checkpoint.safe_dcp import load_tensors

    config_file = path.parent / "config.json"
    config = read_user_json(config_file, what="the run's config.json", nan_ok=True,
                            missing=f"{path} has no config.json beside it to say which model it holds; pass the "
                            "run's checkpoint folder or a `scale-ocr export` file")
    try:
        # config.json records the task's own identity keys (the recognizer's vocabulary's characters) at its
        # top level, and the architecture, input size and size overrides in its model section.
        section = config["model"]
        identity = {**config, "arch": section["arch"], "input_size": section["input_size"],
                    **{k: section[k] for k in MODEL_IDENTITY_FIELDS if section.get(k) is not None}}
    except (ValueError, KeyError, TypeError):
        raise UserError(f"{config_file} does not describe a model (model.arch, model.input_size); "
                        "the run directory is damaged") from None
    try:
        state = load_tensors(path, meta=layout_only)  # a refused global (a crafted file) is already one line
    except UserError:
        raise
    except Exception as exc:  # noqa: BLE001 - truncated or foreign files raise several types
        raise UserError(f"{path} cannot be read ({type(exc).__name__}); it is truncated or not a torch file") from None
    if not isinstance(state, dict):
        raise UserError(f"{path} is not a state dict written by scale-ocr")
    # config.json is checked against the registry and the weights' shapes before a build
    model, task = _checked(identity, tensors_elements(state), path, config_file,
                           f"{config_file} does not describe a model (model.arch, model.input_size); the run "
                           "directory is damaged", layout_only=layout_only)
    return model, task, state


def load_run_weights(path: Path) -> LoadedModel:
    """A run's ``best_model.pt`` or ``last_model.pt``, ready for inference."""
    model, task, state = _run_weights(path, layout_only=False)
    return _with_weights(model, task, state, path)


def _existing(path: str | Path) -> Path:
    p = Path(path)
    if not p.exists():
        raise UserError(f"{p} does not exist; pass a checkpoint folder, a run directory, a .safetensors export "
                        "or a run's best_model.pt")
    return p


def _is_torch_file(p: Path) -> bool:
    """``p`` (a file) is a run's ``.pt`` model: named so, and not a safetensors file by its content (an export
    written under a ``.pt`` name is read as the export it is)."""
    from scale_ocr.checkpoint.weights_io import holds_safetensors

    return not holds_safetensors(p) and p.suffix == ".pt"


def load_any(path: str | Path) -> LoadedModel:
    """A checkpoint folder or run directory, a ``.safetensors`` export, or a run's
    ``best_model.pt``/``last_model.pt``."""
    p = _existing(path)
    if p.is_dir():
        return load_checkpoint_model(p)
    return load_run_weights(p) if _is_torch_file(p) else load_export(p)


@dataclass
class Weights:
    """A model file opened to be read one tensor at a time: ``layout`` is its model on the meta device (built for
    real when it cannot be built there, a small docTR model), ``read`` one tensor by its state-dict name."""

    layout: nn.Module
    task: Task
    read: Callable[[str], torch.Tensor]
    source: str = ""

    def tensor(self, spec: TensorSpec) -> torch.Tensor:
        """The tensor ``spec`` names, in its dtype; one line when the file holds it in no fitting shape."""
        try:
            tensor = self.read(spec.name)
        except KeyError:
            raise UserError(f"{self.source} does not match {self.task.arch}: it holds no {spec.name}") from None
        if tuple(tensor.shape) != spec.shape:
            raise UserError(f"{self.source} does not match {self.task.arch}: {spec.name} is "
                            f"{list(tensor.shape)}, the model's {list(spec.shape)}")
        return tensor.to(spec.dtype)

    def specs(self) -> list[TensorSpec]:
        """Every tensor of the model, as an export writes it (floating point in fp32)."""
        return [TensorSpec(k, tuple(v.shape), torch.float32 if v.is_floating_point() else v.dtype)
                for k, v in self.layout.state_dict().items()]


@contextmanager
def open_weights(path: str | Path) -> Iterator[Weights]:
    """A checkpoint folder or run directory, a ``.safetensors`` export, or a run's ``.pt`` model, opened to be read
    a tensor at a time (through DCP, safetensors, or :class:`TorchFileReader`)."""
    p = _existing(path)
    if p.is_dir():
        yield _checkpoint_weights(p)
    elif _is_torch_file(p):
        layout, task, state = _run_weights(p, layout_only=True)
        yield Weights(layout, task, TorchFileReader(p, state).read, str(p))
    else:
        from safetensors import safe_open

        layout, task = _export_identity(p)
        with safe_open(str(p), framework="pt") as f:
            yield Weights(layout, task, f.get_tensor, str(p))


def _checkpoint_weights(path: Path) -> Weights:
    from scale_ocr.checkpoint import safe_dcp

    ckpt, meta, held, listed = _checkpoint_identity(path)
    layout, task = _checked(meta, held, ckpt, ckpt / "trainer.json", _damaged(ckpt), layout_only=True)
    shapes = {k: (v.shape, v.dtype) for k, v in layout.state_dict().items()}

    def read(name: str) -> torch.Tensor:
        shape, dtype = shapes[name]
        state = {"model": {name: torch.empty(shape, dtype=dtype)}}
        _read_dcp(ckpt, lambda: safe_dcp.load(state, ckpt, listed, no_dist=True))
        return state["model"][name]

    return Weights(layout, task, read, str(path))


def save_export(model: nn.Module, task: Task, out: str | Path) -> Path:
    """Write the in-memory ``model`` as :func:`export` writes a file's."""
    state = model.state_dict()
    return write_export(Weights(model, task, state.__getitem__, "the model"), out)


def write_export(weights: Weights, out: str | Path) -> Path:
    """``weights`` as consolidated fp32 safetensors with their task's identity as metadata (``scale-ocr/2``), a
    tensor at a time, whole or not at all."""
    identity = weights.task.identity()
    # Each identity field also as its own string entry, for readers that do not parse JSON.
    meta = {**{k: v if isinstance(v, str) else json.dumps(v) for k, v in identity.items()},
            "identity": json.dumps(identity), "format": "scale-ocr/2"}
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    specs = weights.specs()
    kept = "the model it was exported from is untouched" + (f" and the previous {out.name} is "
                                                            "kept" if out.exists() else "")
    # Whole or not at all (a temp file renamed over OUT), never through a link; a full disk is one line.
    with atomic_file(out, what="the export", kept=kept, needed=sum(s.nbytes for s in specs)) as f:
        writer = SafetensorsFile(f, specs, meta)
        for spec in specs:
            writer.put(weights.tensor(spec))
        writer.close()
    return out


FORMATS = ("safetensors", "doctr")


def export(src: str | Path, out: str | Path, fmt: str = "safetensors") -> Path:
    """Write ``src``'s model as :func:`write_export` or (``doctr``) :func:`write_doctr` writes it."""
    if fmt not in FORMATS:
        raise UserError(f"--format {fmt}: choose one of {', '.join(FORMATS)}")
    out = check_output(out, "OUT")  # never a run's own file (its last_model.pt), a link, or into a missing folder
    if fmt == "doctr":
        check_output(out.with_suffix(".json"), "OUT's sidecar")
    with open_weights(src) as weights:
        return write_doctr(weights, out)[0] if fmt == "doctr" else write_export(weights, out)


def write_doctr(weights: Weights, out: str | Path) -> tuple[Path, str]:
    """``weights`` as the plain state dict docTR's class of the architecture loads with ``strict=True``, and beside it
    ``OUT.json`` with what that class must be built with; returns the file and docTR's architecture."""
    from scale_ocr.checkpoint.weights_io import doctr_layout

    doctr_arch, to_doctr = doctr_layout(weights.layout, weights.task.arch)
    ours = weights.specs()
    # docTR's names and shapes, from the layout's own tensors (on the meta device: no memory)
    layout, theirs = weights.layout.state_dict(), []
    for spec in ours:
        ((name, tensor),) = to_doctr({spec.name: layout[spec.name]}).items()
        theirs.append(TensorSpec(name, tuple(tensor.shape), spec.dtype))
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    kept = "the checkpoint it was exported from is untouched"
    # atomic: a reader sees the old file or the new one, never half of one; a full disk is one line
    with atomic_file(out, what="the export", kept=kept, needed=sum(s.nbytes for s in theirs)) as f:
        writer = TorchFile(f, theirs)
        for spec in ours:
            ((_, tensor),) = to_doctr({spec.name: weights.tensor(spec)}).items()
            writer.put(tensor)
        writer.close()
    write_atomic(out.with_suffix(".json"), json.dumps({"doctr_arch": doctr_arch, **doctr_info(weights.task)},
                                                      ensure_ascii=False, indent=1) + "\n",
                 what="the export's sidecar", kept=kept)
    return out, doctr_arch


def doctr_info(task) -> dict[str, Any]:
    """What docTR's class must be built with to hold the task's model weights, and how to feed it: the input shape
    and normalisation, and a recognizer's vocabulary and padding."""
    info: dict[str, Any] = {"input_shape": [3, *task.input_size], "mean": list(task.mean), "std": list(task.std)}
    if hasattr(task, "vocab"):
        info = {"vocab": task.vocab.chars, **info,
                "padding": "black" if task.pad_fill == 0 else "the crop's border colour (docTR pads black)"}
    return info
