import pytest
import torch

from scale_ocr.config import OptimConfig, StrategyConfig, TrainConfig
from scale_ocr.distributed.process_group import DistInfo
from scale_ocr.errors import UserError
from scale_ocr.optim import LRSchedule, build_optimizer_spec, lr_factor, param_groups
from scale_ocr.strategies import create_strategy, list_strategies, register_strategy
from scale_ocr.strategies.single import SingleDevice

EXPECTED = {"single", "dp", "ddp", "fsdp", "fsdp_grad_op", "zero1", "zero2", "zero3", "zero2_offload",
            "zero3_offload", "deepspeed", "fairscale"}


def _dist(world=1, launcher="python"):
    return DistInfo(0, world, 0, world, torch.device("cpu"), "gloo", launcher)


def test_registry_holds_every_strategy():
    assert EXPECTED <= set(list_strategies())


def test_unknown_strategy_lists_valid_names():
    with pytest.raises(UserError) as err:
        create_strategy(StrategyConfig(strategy="zero4"), _dist(), TrainConfig(), OptimConfig())
    assert "zero3_offload" in str(err.value) and "fairscale" in str(err.value)


def test_duplicate_registration_is_an_error():
    with pytest.raises(ValueError, match="twice"):
        register_strategy("ddp", SingleDevice, "again")


@pytest.mark.parametrize("name", ["dp", "single"])
def test_single_process_strategies_refuse_multi_rank(name):
    with pytest.raises(UserError, match="one process"):
        create_strategy(StrategyConfig(strategy=name), _dist(2, "torchrun"), TrainConfig(), OptimConfig())


def test_ds_config_only_for_deepspeed(tmp_path):
    with pytest.raises(UserError, match="DeepSpeed strategies only"):
        create_strategy(StrategyConfig(strategy="ddp", ds_config="x.json"), _dist(), TrainConfig(), OptimConfig())
    with pytest.raises(UserError, match="needs --ds-config"):
        create_strategy(StrategyConfig(strategy="deepspeed"), _dist(), TrainConfig(), OptimConfig())


def test_param_groups_skip_decay_on_vectors():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    decay, no_decay = param_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and len(decay["params"]) == 1
    assert no_decay["weight_decay"] == 0.0 and len(no_decay["params"]) == 3


@pytest.mark.parametrize("sched", ["cosine", "onecycle", "constant"])
def test_schedules_shape(sched):
    f = lr_factor(sched, total_steps=100, warmup_steps=10 if sched != "onecycle" else 0)
    values = [f(s) for s in range(100)]
    assert max(values) <= 1.0 + 1e-9 and min(values) >= 0
    if sched != "constant":
        assert values[-1] < 0.05 and values[0] < max(values)


def test_lr_schedule_sets_param_groups():
    spec = build_optimizer_spec(OptimConfig(lr=0.1, sched="cosine"))
    opt = spec.build(torch.nn.Linear(2, 2))
    sched = LRSchedule(opt, 0.1, lr_factor("cosine", 10, 0))
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1)
    for _ in range(5):
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)
    assert all(g["lr"] == opt.param_groups[0]["lr"] for g in opt.param_groups)
