"""Run under torchrun: build a model the way a strategy does and report its initial weights and host memory.

``torchrun --nproc_per_node 2 tests/distributed/init_probe.py STRATEGY OUT.json ARCH:WIDTH:DEPTH:COMPARE...``
builds each model in turn. Rank 0 writes one ``{"max_abs_diff": <vs a whole build with the same seed>,
"peak_rss_growth": <bytes the build added to this rank's peak RSS>, "whole_bytes": <the model's fp32
bytes>}`` per model; with COMPARE 0 (a model too large to also build whole) ``max_abs_diff`` is null.
"""

import json
import resource
import sys

from scale_ocr.config import ModelConfig, OptimConfig, StrategyConfig, TrainConfig
from scale_ocr.distributed import destroy_distributed, init_distributed
from scale_ocr.optim import build_optimizer_spec
from scale_ocr.strategies import create_strategy
from scale_ocr.strategies.base import Strategy
from scale_ocr.tasks import create_task


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def probe(strategy, dist, arch: str, width: str, depth: str, compare: str) -> dict:
    task = create_task(ModelConfig(arch=arch, model_width=int(width), model_depth=int(depth)))
    spec = build_optimizer_spec(OptimConfig())
    before = peak_rss()
    model = strategy.build_model(task, seed=7)
    built = peak_rss()
    decayed = [len(g["params"]) for g in spec.groups(model) if g["weight_decay"] > 0]  # as the strategy groups them
    wrapped, _ = strategy.setup(model, spec)
    growth = built - before  # the build alone: engines allocate optimizer state in setup (ZeRO's fp32 masters)
    whole = strategy.full_state_dict() if compare == "1" else None
    diff = None
    if whole is not None:
        reference_model = Strategy.build_model(strategy, task, seed=7)  # the base class: built whole
        reference = reference_model.state_dict()
        assert list(reference) == list(whole), (list(reference)[:5], list(whole)[:5])
        diff = max((reference[k].float() - whole[k].float()).abs().max().item() for k in reference)
        expected = [len(g["params"]) for g in spec.groups(reference_model) if g["weight_decay"] > 0]
        assert decayed == expected, f"weight decay on {decayed} parameters, {expected} when built whole"
    n = sum(getattr(p, "ds_numel", p.numel()) for p in wrapped.parameters())  # DTensor: global; ZeRO-3: ds_numel
    return {"max_abs_diff": diff, "peak_rss_growth": growth, "whole_bytes": 4 * n}


def main() -> None:
    name, out, specs = sys.argv[1], sys.argv[2], sys.argv[3:]
    dist = init_distributed("gloo")
    if name.startswith("zero"):
        import deepspeed  # noqa: F401 - its import is not the build's memory
    results = []
    for spec in specs:
        strategy = create_strategy(StrategyConfig(strategy=name), dist, TrainConfig(), OptimConfig())
        results.append(probe(strategy, dist, *spec.split(":")))
        strategy.teardown()
    if dist.is_main:
        with open(out, "w") as f:
            json.dump(results, f)
    destroy_distributed()


if __name__ == "__main__":
    main()
