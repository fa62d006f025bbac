"""What a run reports at its end: the dict train.py prints and writes into ``metrics.json``, agreed over the ranks
(every rank makes the same collective calls in the same order, rank 0's copy is the one written).
"""

from __future__ import annotations

import resource
from typing import TYPE_CHECKING, Any

import torch

from scale_ocr.distributed.process_group import all_reduce_max, all_reduce_sum
from scale_ocr.errors import say
from scale_ocr.memory.meter import peak_breakdown
from scale_ocr.run.breakdown import memory_breakdown, time_breakdown

if TYPE_CHECKING:
    from scale_ocr.run.trainer import Trainer

DATA_SHARE_NOTE = 0.1  # a run that waited this share of its training time on the loader says how to avoid it


def peak_memory_bytes(device: torch.device) -> int:
    """This process's peak memory: CUDA max allocated on GPU, peak resident set size on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def run_summary(t: Trainer, wall: float) -> dict[str, Any]:
    """The run's results: steps, losses and metrics, speed, memory and where the time went."""
    state, device = t.state, t.device
    peak = all_reduce_max(peak_memory_bytes(device), device)
    local = float(torch.stack(state.epoch_loss).sum()) if state.epoch_loss else 0.0
    timed = state.timed_seconds
    share = state.timed_data_seconds / timed if timed > 0 else 0.0
    loss_sum, n, share_sum, flops = all_reduce_sum([local, len(state.epoch_loss), share, state.timed_flops], device)
    sps = state.timed_samples / timed if timed > 0 else float("nan")
    data_share = share_sum / t.strategy.world_size if timed > 0 else None
    if data_share is not None and data_share >= DATA_SHARE_NOTE and t.strategy.is_main:
        say(f"scale-ocr: note: the ranks waited for data {data_share:.0%} of the timed training time; "
            f"{t.data.speedup_hint}", err=True)
    ev = state.last_eval
    return {
        "world_size": t.strategy.world_size,
        "global_batch": t.ramp.global_batch,
        "steps": state.step,
        "samples": state.samples,
        "batch_ramp": t.ramp.summary(),  # where --batch-ramp started and ended, and each change
        "epochs": state.epoch,
        "train_loss": loss_sum / n if n else None,  # None: nothing trained (resumed at the last step)
        "val_loss": ev.get("val_loss"),
        **{k: ev.get(k) for k in t.task.metric_names},
        f"best_{t.task.metric_names[0]}": state.best[0] if state.best else None,
        "samples_per_sec": sps,
        **t.plan.utilization.summary(flops / timed if timed > 0 else float("nan")),  # mfu, flops_per_sample, peak
        "data_share": data_share,
        "peak_memory_bytes": int(peak),
        "peak_reserved_bytes": (int(all_reduce_max(torch.cuda.max_memory_reserved(device), device))
                                if device.type == "cuda" else None),
        "state_bytes": _state_bytes(t),
        "memory_breakdown": memory_breakdown(peak_breakdown(
            device, t.strategy.memory_report(), t.strategy.meter and t.strategy.meter.process_at_peak,
            t.activations.bytes), t.strategy.rank, device),
        "comm_share": _comm_share(t),
        "time_breakdown": time_breakdown(t.clock, t.profiler and t.profiler.comm,
                                         timed / state.timed_steps if state.timed_steps else None,
                                         device, t.strategy.world_size),
        "noise_scale": t.noise.summary(),  # B_simple as last smoothed, and how it was measured
        # samples drawn from each source of a mix (scale_ocr.data.mix), the whole run's, up to its last step (not
        # the epoch the loop moved on to after it); None for one source
        "data_drawn": t.data.position.drawn(getattr(t, "ended_at", None) or t.data_position())
        if hasattr(t.data.position, "drawn") else None,
        "nonfinite_steps": state.skipped_steps,
        "wall_seconds": wall,
    }


def _comm_share(t: Trainer) -> float | None:
    """Largest share over ranks of profiled time with a collective in flight (None unless profiled)."""
    if t.profiler is None:
        return None
    share = all_reduce_max(t.profiler.share if t.profiler.share is not None else -1.0, t.device)
    return share if share >= 0 else None


def _state_bytes(t: Trainer) -> dict[str, int] | None:
    """Model-state bytes by category, the largest over ranks (sharded engines split unevenly)."""
    report = t.strategy.memory_report()
    fields = ("params", "grads", "optimizer", "other", "host", "disk", "model_state")
    local = report.as_dict() if report is not None else dict.fromkeys(fields, -1)
    peak = {k: int(all_reduce_max(local[k], t.device)) for k in fields}  # same calls on every rank
    return peak if peak["model_state"] >= 0 else None
