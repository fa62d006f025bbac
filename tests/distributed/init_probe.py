"""Run under torchrun: build a model the way a strategy does and report its initial weights and host memory.

``torchrun --nproc_per_node 2 tests/distributed/init_probe.py OUT.json STRATEGY:ARCH:WIDTH:DEPTH:COMPARE...``
builds each model in turn, under its strategy. Rank 0 writes one \
``{"max_abs_diff": <vs a whole build with the same seed>,
"peak_rss_growth": <bytes the build added to this rank's peak RSS>, "whole_bytes": <the model's fp32
bytes>, "weight_norm": <the strategy's, with any padding of its partitions set to NaN first>, "padded": <partitions so
poisoned>, "norm": <the whole build's>}`` per model; with COMPARE 0 (a model too large to also build whole) the
comparisons are null.
"""

import json
import resource
import sys

import torch

from scale_ocr.config import ModelConfig, OptimConfig, StrategyConfig, TrainConfig
from scale_ocr.distributed.process_group import destroy_distributed, init_distributed
from scale_ocr.models.init import full_numel
from scale_ocr.optim import build_optimizer_spec
from scale_ocr.strategies import create_strategy
from scale_ocr.strategies.base import Strategy
from scale_ocr.tasks import create_task


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def probe(strategy, dist, arch: str, width: str, depth: str, compare: str) -> dict:
    """COMPARE 1: build, set up and gather the weights; 0: only build (what the memory bound is about)."""
    task = create_task(ModelConfig(arch=arch, model_width=int(width), model_depth=int(depth)))
    spec = build_optimizer_spec(OptimConfig())
    before = peak_rss()
    model = strategy.build_model(task.model_factory(), seed=7)
    growth = peak_rss() - before  # the build alone: engines allocate optimizer state in setup (ZeRO's fp32 masters)
    n = sum(full_numel(p) for p in model.parameters())
    if compare != "1":
        return {"max_abs_diff": None, "peak_rss_growth": growth, "whole_bytes": 4 * n}
    decayed = [len(g["params"]) for g in spec.groups(model) if g["weight_decay"] > 0]  # as the strategy groups them
    strategy.setup(model, spec)
    padded = _poison_padding(strategy, model)
    weight_norm = float(strategy.weight_norm())
    whole = {piece.name: piece.fetch() for piece in strategy.model_pieces()}  # a collective per piece
    diff = norm = None
    if dist.is_main:
        reference_model = Strategy.build_model(strategy, task.model_factory(), seed=7)  # the base class: built whole
        reference = reference_model.state_dict()
        assert list(reference) == list(whole), (list(reference)[:5], list(whole)[:5])
        diff = max((reference[k].float() - whole[k].float()).abs().max().item() for k in reference)
        expected = [len(g["params"]) for g in spec.groups(reference_model) if g["weight_decay"] > 0]
        assert decayed == expected, f"weight decay on {decayed} parameters, {expected} when built whole"
        norm = float(torch.linalg.vector_norm(torch.cat([v.detach().reshape(-1) for v in reference.values()
                                                         if v.is_floating_point()])))  # weights and buffers
    return {"max_abs_diff": diff, "peak_rss_growth": growth, "whole_bytes": 4 * n, "weight_norm": weight_norm,
            "padded": padded, "norm": norm}


def _poison_padding(strategy, model) -> int:
    """ZeRO-3: set the padding after the last rank's partition of each parameter to NaN (DeepSpeed leaves it
    uninitialized: whatever memory held before); returns how many partitions have padding, over the ranks."""
    from scale_ocr.strategies import deepspeed_internals as internals

    if getattr(strategy, "zero_stage", 0) != 3:
        return 0
    padded = 0
    for p in model.parameters():
        start, size = internals.zero3_partition_range(strategy.engine.optimizer, p)
        real = max(0, min(size, full_numel(p) - start))
        if real < size:
            internals.param_partition(p).view(-1)[real:] = float("nan")
            padded += 1
    count = torch.tensor([padded])
    torch.distributed.all_reduce(count)  # the padding is the last rank's
    return int(count)


def main() -> None:
    out, specs = sys.argv[1], [spec.split(":") for spec in sys.argv[2:]]
    dist = init_distributed("gloo")
    if any(name.startswith("zero") for name, *_ in specs):
        import deepspeed  # noqa: F401 - its import is not the build's memory
    results = []
    for name, *spec in specs:
        strategy = create_strategy(StrategyConfig(strategy=name), dist, TrainConfig(), OptimConfig())
        results.append(probe(strategy, dist, *spec))
        strategy.teardown()
    if dist.is_main:
        with open(out, "w") as f:
            json.dump(results, f)
    destroy_distributed()


if __name__ == "__main__":
    main()
