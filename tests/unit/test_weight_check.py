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


def test_single_strategy_measures_the_norm_of_its_trainable_weights():
    from scale_ocr.config import OptimConfig, StrategyConfig
    from scale_ocr.distributed.process_group import DistInfo
    from scale_ocr.strategies.single import SingleDevice

    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    strategy = SingleDevice(StrategyConfig(), DistInfo(0, 1, 0, 1, torch.device("cpu"), "gloo", "python"),
                            TrainConfig(), OptimConfig())
    strategy.model = model
    model[0].bias.requires_grad_(False)  # frozen weights are not the optimizer's: left out
    expected = torch.linalg.vector_norm(torch.cat([p.detach().reshape(-1) for p in model.parameters()
                                                   if p.requires_grad]))
    assert float(strategy.weight_norm()) == pytest.approx(float(expected), rel=1e-6)
