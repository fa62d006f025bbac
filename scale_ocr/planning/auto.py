"""``--strategy auto``: the fastest strategy predicted to fit in each device's memory (docs/memory.md).

Strategies are tried from the fastest to the slowest (replicated first, then sharded gradients/optimizer, then
sharded parameters, then offload); the first that fits is chosen, and the choice and why are printed in one line.
"""

from __future__ import annotations

import os
from dataclasses import replace

import torch

from scale_ocr.config import RunConfig
from scale_ocr.distributed.launch_env import read_launch
from scale_ocr.errors import UserError, say
from scale_ocr.memory.model import step_peak

#: Fastest first, as the quick benchmark ranks them.
MULTI_RANK_ORDER = ("ddp", "zero2", "zero1", "fairscale", "fsdp_grad_op", "fsdp", "zero3", "zero2_offload",
                    "zero3_offload")
SINGLE_RANK_ORDER = ("single", "zero2_offload", "zero3_offload")
GIB = 2**30


def device_memory_bytes(cfg: RunConfig, local_world: int) -> tuple[int, str]:
    """Per-rank memory to plan for, and where the figure comes from."""
    if cfg.strategy.device_memory_gb:
        return int(cfg.strategy.device_memory_gb * GIB), "--device-memory-gb"
    if torch.cuda.is_available() and cfg.strategy.backend != "gloo":
        return torch.cuda.get_device_properties(0).total_memory, torch.cuda.get_device_name(0)
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return host // max(local_world, 1), f"host RAM shared by {local_world} local rank(s)"


def runtime_margin(on_gpu: bool) -> int:
    """What the process needs besides model state and activations: CUDA context and allocator slack on
    GPU; the interpreter, torch's libraries and the data pipeline on CPU."""
    return int(0.75 * GIB) if on_gpu else 1 * GIB


def rank_need(row: dict, largest_layer: int, on_gpu: bool, activations: float = 0.0) -> float:
    """Bytes a rank needs: the larger of an ``estimate`` row's step peak (plus ``activations``, and two gathered
    largest units for engines that gather) and its save peak, plus the runtime margin. A CPU rank's device is the
    host, so there offloading keeps nothing off it."""
    on_host = 0.0 if on_gpu else row["host"]
    gathered = 2 * 4 * largest_layer if row["params_sharded"] else 0
    acts = (row["activations"] or 0) + activations
    step = step_peak(row["resident_state"] + on_host, row["grads"], acts, row["grads_freed"]) + gathered
    return max(step, row["save"] + on_host) + runtime_margin(on_gpu)


def memory_needs(cfg: RunConfig, world: int) -> tuple[dict[str, int], dict[str, float], dict[str, int]]:
    """Bytes per rank each candidate needs, fastest first; its model state; its measured activations."""
    from scale_ocr.planning.estimate import estimate, measure_activations, model_size
    from scale_ocr.tasks import create_task

    task = create_task(cfg.model)
    model = task.build_model()
    size = model_size(model)
    acts = measure_activations(model, task.dummy_inputs(cfg.train.batch_size), cfg.train.precision)
    on_gpu = torch.cuda.is_available() and cfg.strategy.backend != "gloo"
    order = SINGLE_RANK_ORDER if world == 1 else MULTI_RANK_ORDER
    doc = estimate(size, world, cfg.train.precision, list(order), activations=acts, model=model)
    needs, state, activations = {}, {}, {}
    for name in order:
        row = doc["strategies"][name]
        needs[name] = int(rank_need(row, size.largest_layer, on_gpu))
        state[name], activations[name] = row["model_state"], row["activations"]
    return needs, state, activations


def choose_strategy(cfg: RunConfig, world: int, local_world: int) -> tuple[str, str]:
    """(strategy name, one-line reason) for this model, batch, precision and world size."""
    needs, state, acts = memory_needs(cfg, world)
    order = list(needs)
    capacity, source = device_memory_bytes(cfg, local_world)
    fits = [n for n in order if needs[n] <= capacity]
    if not fits:
        best = min(needs, key=needs.get)
        raise UserError(
            f"--strategy auto: nothing fits {capacity / GIB:.1f} GiB per rank ({source}); the smallest, {best}, needs "
            f"{needs[best] / GIB:.1f} GiB with activations {acts[best] / GIB:.1f} GiB at --batch-size "
            f"{cfg.train.batch_size}; "
            "lower the batch size or add ranks")
    pick = fits[0]
    skipped = order[: order.index(pick)]
    why = (f"{pick} is the fastest that fits: needs {needs[pick] / GIB:.2f} of {capacity / GIB:.1f} GiB per rank "
           f"({source}; model state {state[pick] / GIB:.2f}, activations {acts[pick] / GIB:.2f})")
    if skipped:
        why += f"; {skipped[-1]} would need {needs[skipped[-1]] / GIB:.2f} GiB"
    return pick, why


def resolve_auto(cfg: RunConfig, world: int, launcher: str) -> RunConfig:
    """The config with ``--strategy auto`` replaced by the chosen name (printed once, by rank 0)."""
    if cfg.strategy.strategy != "auto":
        return cfg
    local_world = read_launch().local_world_size  # checked: not a stale LOCAL_WORLD_SIZE a plain job does not read
    name, why = choose_strategy(cfg, world, local_world)
    say(f"scale-ocr: --strategy auto -> {why}", every_rank=False)
    return replace(cfg, strategy=replace(cfg.strategy, strategy=name))
