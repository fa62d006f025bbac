"""Model-state bytes counted from the tensors a rank really holds (peak RSS mixes in caching and activations).

Each strategy lists its tensors by category; :class:`StateMeter` sums their distinct storages at the optimizer
step, where model state peaks, so views are not double-counted (docs/memory.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import resource
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch


def resident_bytes() -> int:
    """This process's resident set size now (0 where /proc is not there)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def process_bytes(device: torch.device) -> int:
    """What the process holds now: CUDA's allocated bytes on a GPU, the resident set on CPU."""
    return int(torch.cuda.memory_allocated(device)) if device.type == "cuda" else resident_bytes()


#: Resident bytes when the package's engines were imported, before any model: the interpreter, torch and its
#: libraries. A CPU rank's peak holds it besides its tensors.
RUNTIME_BYTES = resident_bytes()

#: Claim order: a storage reachable as a parameter is a parameter even if an engine also keeps it elsewhere.
CATEGORIES = ("params", "grads", "optimizer", "other")


@dataclass(frozen=True)
class StateBytes:
    """Bytes one rank holds, by category (``other``: engine buffers such as reduce buckets).

    ``host`` is the part of the rest in host memory while the device is an accelerator (0 on CPU runs); ``disk``
    the rank's swap files (NVMe offload), not part of the rest.
    """

    params: int = 0
    grads: int = 0
    optimizer: int = 0
    other: int = 0
    host: int = 0
    disk: int = 0

    @property
    def model_state(self) -> int:
        """Parameters + gradients + optimizer state: what the ZeRO paper's formulas describe."""
        return self.params + self.grads + self.optimizer

    def as_dict(self) -> dict[str, int]:
        return {**asdict(self), "model_state": self.model_state}


def tensors_in(obj: Any, depth: int = 3) -> Iterator[torch.Tensor]:
    """Tensors inside nested lists, tuples and dicts (DeepSpeed keeps its partitions that way)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth > 0 and isinstance(obj, (dict, list, tuple)):
        for v in obj.values() if isinstance(obj, dict) else obj:
            yield from tensors_in(v, depth - 1)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: the local shard of a DTensor (FSDP2), ``t`` itself otherwise."""
    return t.to_local() if hasattr(t, "to_local") and hasattr(t, "device_mesh") else t


def count_state(groups: dict[str, Iterable[torch.Tensor | None]], device: torch.device) -> StateBytes:
    """Sum the distinct storages of ``groups`` (category -> tensors), first claim wins."""
    seen: set[tuple[str, int]] = set()
    sizes = dict.fromkeys(CATEGORIES, 0)
    host = 0
    for cat in CATEGORIES:
        for t in groups.get(cat, ()):
            if t is None:
                continue
            t = local_tensor(t)
            storage = t.untyped_storage()
            key = (str(t.device), storage.data_ptr())
            if storage.nbytes() == 0 or key in seen:
                continue
            seen.add(key)
            sizes[cat] += storage.nbytes()
            if device.type != "cpu" and t.device.type == "cpu":
                host += storage.nbytes()
    return StateBytes(**sizes, host=host)


class StateMeter:
    """Counts a strategy's state at the optimizer step (a step pre-hook on the ``optimizer`` that actually steps)
    and keeps the largest.

    ``samples``: optimizer-step calls counted before the hook removes itself (ZeRO-3 passes twice its sub-group
    count): what an engine holds does not change from step to step, so two steps find the peak and later steps
    pay nothing.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, collect: Callable[[], dict[str, Iterable]],
                 device: torch.device, samples: int = 2, disk: Callable[[], int] | None = None) -> None:
        self.collect, self.device, self.disk = collect, device, disk
        self.peak: StateBytes | None = None
        self.process_at_peak: int | None = None  # process_bytes() when the peak was counted
        self._remaining = samples
        self._handle = optimizer.register_step_pre_hook(self._on_step)

    def _on_step(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        # Adam builds its moments during a parameter's first step: until every parameter about to be
        # stepped has state, the count would miss them. (DeepSpeed's ZeRO-3 steps one sub-group at a time.)
        if any(p not in optimizer.state for g in optimizer.param_groups for p in g["params"]):
            return
        now = count_state(self.collect(), self.device)
        if self.disk is not None:  # swap files only grow as sub-groups first step: keep their largest size
            now = dataclasses.replace(now, disk=max(self.disk(), self.peak.disk if self.peak else 0))
        if self.peak is None or now.model_state + now.other >= self.peak.model_state + self.peak.other:
            self.peak, self.process_at_peak = now, process_bytes(self.device)
        elif now.disk > self.peak.disk:
            self.peak = dataclasses.replace(self.peak, disk=now.disk)
        self._remaining -= 1
        if self._remaining <= 0:
            self._handle.remove()


def module_tensors(module: torch.nn.Module) -> dict[str, list[torch.Tensor | None]]:
    """Parameters and their gradients of a plain, DDP- or FSDP2-wrapped module."""
    params = list(module.parameters())
    return {"params": params, "grads": [p.grad for p in params]}


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Everything in a torch optimizer's per-parameter state (moments, step counters)."""
    return [t for st in optimizer.state.values() for t in tensors_in(st)]


class ActivationProbe:
    """Bytes of the tensors autograd saves in the first micro-batch's forward (``saved_tensors_hooks``), distinct
    storages once, the rank's own parameters left out (the meter counts them); compiled modules are skipped, as their
    graphs save tensors inside the compiled region (docs/memory.md, "At the peak")."""

    def __init__(self) -> None:
        self.bytes: int | None = None
        self._seen: set[int] = set()
        self._done = False

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        with contextlib.suppress(RuntimeError, NotImplementedError):  # tensors without storage
            storage = local_tensor(t).untyped_storage()
            if storage.data_ptr() not in self._seen:
                self._seen.add(storage.data_ptr())
                self.bytes = (self.bytes or 0) + storage.nbytes()
        return t

    def watch(self, model: torch.nn.Module) -> contextlib.AbstractContextManager:
        """Measure inside this context the first time (wrap the forward); a no-op after."""
        if self._done or getattr(model, "_compiled_call_impl", None) is not None:
            return contextlib.nullcontext()
        self._done = True
        self.bytes = 0
        # The parameters' storages (views of them too, such as a Linear's transposed weight) are the meter's.
        self._seen = {local_tensor(p).untyped_storage().data_ptr() for p in model.parameters()}
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)


def peak_breakdown(device: torch.device, state: StateBytes | None, at_step: int | None,
                   activations: int | None) -> dict[str, int | None]:
    """Memory at this rank's peak, split beside the meter's model state (docs/memory.md, "At the peak")."""
    state_bytes = state.model_state if state is not None else None
    other = state.other if state is not None else None
    known = sum(v for v in (state_bytes, other, activations) if v is not None)
    if device.type == "cuda":
        stats = torch.cuda.memory_stats(device)
        allocated = int(stats.get("allocated_bytes.all.peak", 0))
        reserved = int(stats.get("reserved_bytes.all.peak", 0))
        return {"peak_allocated": allocated, "peak_reserved": reserved,
                "peak_active": int(stats.get("active_bytes.all.peak", 0)),
                "peak_inactive_split": int(stats.get("inactive_split_bytes.all.peak", 0)),
                "model_state": state_bytes, "engine_buffers": other, "activations": activations,
                "temporaries": allocated - known, "allocator": reserved - allocated, "at_step": at_step}
    peak = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB
    return {"peak_rss": peak, "runtime": RUNTIME_BYTES, "model_state": state_bytes, "engine_buffers": other,
            "activations": activations, "heap": peak - RUNTIME_BYTES - known, "at_step": at_step}
