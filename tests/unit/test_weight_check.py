"""The weight check that makes a step bad when the updated weights are NaN/inf or grew past their bound (row 67)."""

from __future__ import annotations

import math

import pytest
import torch

from scale_ocr.config import TrainConfig
from scale_ocr.errors import UserError
from scale_ocr.run.control import WeightCheck


def _check(norms: list[float | None], growth: float = 1000.0) -> WeightCheck:
    values = iter(norms)
    return WeightCheck(lambda: (lambda v: None if v is None else torch.tensor(v))(next(values)), growth)


def test_bound_is_growth_times_the_start_floored_at_one():
    check = _check([2.0, 1999.0, 2001.0, math.inf, math.nan])
    assert check.bound == 2000.0
    assert check.after_step() and not check.after_step()  # 1999 within, 2001 past
    assert "past 2e+03" in check.describe()
    assert not check.after_step() and "infinite norm" in check.describe()
    assert not check.after_step() and check.describe() == "hold NaN"
    assert _check([0.01]).bound == 1000.0  # a tiny start does not make every step bad


def test_an_engine_that_cannot_measure_is_never_a_bad_step():
    check = _check([None, None])
    assert check.after_step() and check.record() == {"finite": None, "norm": None, "bound": None, "within_bound": True}


def test_record_says_the_weights_were_finite_and_within_bound():
    check = _check([3.0, 4.0])
    check.after_step()
    assert check.record() == {"finite": True, "norm": 4.0, "bound": 3000.0, "within_bound": True}


@pytest.mark.parametrize("growth", [1.0, 0.5, math.nan])
def test_max_weight_growth_must_exceed_one(growth):
    with pytest.raises(UserError, match="--max-weight-growth"):
        TrainConfig(max_weight_growth=growth)


def _single(model: torch.nn.Module):
    from scale_ocr.config import OptimConfig, StrategyConfig
    from scale_ocr.distributed.process_group import DistInfo
    from scale_ocr.strategies.single import SingleDevice

    strategy = SingleDevice(StrategyConfig(), DistInfo(0, 1, 0, 1, torch.device("cpu"), "gloo", "python"),
                            TrainConfig(), OptimConfig())
    strategy.model = model
    return strategy


def test_single_strategy_measures_the_norm_of_its_trainable_weights_and_saved_buffers():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    model[1].register_buffer("scratch", torch.full((4,), 1e6), persistent=False)  # not saved: left out
    strategy = _single(model)
    model[0].bias.requires_grad_(False)  # frozen weights are not the optimizer's: left out
    saved = [p for p in model.parameters() if p.requires_grad] + [model[1].running_mean, model[1].running_var]
    expected = torch.linalg.vector_norm(torch.cat([t.detach().reshape(-1) for t in saved]))
    assert float(strategy.weight_norm()) == pytest.approx(float(expected), rel=1e-6)


def test_a_batchnorm_variance_past_the_bound_is_a_bad_step_though_the_weights_are_not():
    """N05: a "last good" checkpoint held running_var 1.7e11 with weights of norm 1.3e5 (within their bound), and a
    resume from it validated NaN. The saved statistics count as the weights do."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    check = WeightCheck(_single(model).weight_norm, 1000.0)
    with torch.no_grad():
        model[1].running_var.fill_(1.7e11)
    assert not check.after_step() and "past" in check.describe()
    with torch.no_grad():
        model[1].running_var.fill_(math.inf)
    assert not check.after_step() and "infinite norm" in check.describe()
    with torch.no_grad():
        model[1].running_mean[0] = math.nan
    assert not check.after_step() and check.describe() == "hold NaN"


def test_a_start_that_cannot_train_is_unfit_before_any_step():
    """N03 and N05's resume: NaN/inf, a norm fp32 cannot hold (1e38 weights), or a resumed checkpoint whose buffers
    put the norm far past what its trainer.json recorded for the weights alone (kept before buffers counted)."""
    assert _check([math.nan]).unfit_start() == "hold NaN"
    assert "infinite norm" in _check([math.inf]).unfit_start()
    assert _check([1.16e12]).unfit_start(recorded=1.29e5).startswith("have a norm of 1.16e+12 with their buffers")
    assert _check([170.0]).unfit_start(recorded=164.0) is None and _check([None]).unfit_start(recorded=1.0) is None
    assert _check([5.0]).unfit_start(recorded=None) is None


def test_a_checkpoint_from_before_data_records_is_checked_against_its_runs_config(tmp_path):
    """X06 as the probe met it: the checkpoint has no data record, but its run's config.json has the training
    labels' digest (read before the resumed run rewrites it)."""
    import json

    from scale_ocr.run.same_data import recorded_data, same_data

    step = tmp_path / "run" / "checkpoints" / "step_00000004"
    step.mkdir(parents=True)
    (tmp_path / "run" / "config.json").write_text(json.dumps({"dataset": {"train_labels_sha256": "918bacc3c355"}}))
    recorded = recorded_data({"step": 4}, step)
    assert recorded == {"train_sha256": "918bacc3c355"}
    same_data(recorded, {"train_sha256": "918bacc3c355", "val_sha256": None})  # the same data: goes on
    with pytest.raises(UserError, match="data position belongs to another dataset"):
        same_data(recorded, {"train_sha256": "0123456789ab", "val_sha256": None})
    assert recorded_data({"data": {"train_sha256": None}}, step) == {"train_sha256": None}  # synthetic: nothing
