"""16-bit matrix products on CPUs without 16-bit matrix units: computed in fp32, same values, same dtypes."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from scale_ocr.models.recognition.vitstr import Block
from scale_ocr.precision import Fp32Gemm, autocast_factory, emulates_gemm, gemm_factory


def _step(block: nn.Module, x: torch.Tensor, dtype: torch.dtype, mode) -> tuple[torch.Tensor, list[torch.Tensor]]:
    block.zero_grad()
    with mode():
        with torch.autocast("cpu", dtype=dtype):
            y = block(x)
        y.float().square().mean().backward()
    return y.detach(), [p.grad.clone() for p in block.parameters()]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp32_gemm_gives_a_16_bit_runs_values_forward_and_backward(dtype):
    torch.manual_seed(0)
    block, x = Block(64, 4), torch.randn(2, 16, 64)
    calls = []

    class Counting(Fp32Gemm):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            calls.append(func)
            return super().__torch_dispatch__(func, types, args, kwargs)

    y_ref, g_ref = _step(block, x, dtype, contextlib.nullcontext)
    y, g = _step(block, x, dtype, Counting)
    assert y.dtype == y_ref.dtype
    torch.testing.assert_close(y, y_ref, rtol=1e-2, atol=1e-2)  # the same products, summed in another order
    for got, ref in zip(g, g_ref, strict=True):
        assert got.dtype == ref.dtype == torch.float32
        torch.testing.assert_close(got, ref, rtol=2e-2, atol=2e-3)
    # Forward and backward both went through: four linear layers, a product each forward and two each backward.
    assert sum(str(f) in ("aten.addmm.default", "aten.mm.default", "aten.bmm.default") for f in calls) >= 12


def test_fp32_gemm_leaves_fp32_products_alone():
    a, b = torch.randn(8, 4), torch.randn(4, 3)
    with Fp32Gemm():
        out = a @ b
    assert out.dtype == torch.float32 and torch.equal(out, a @ b)


def test_emulation_is_a_host_capability_not_a_setting():
    cpu = torch.device("cpu")
    native = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert emulates_gemm("bf16", cpu) is (not native)
    assert not emulates_gemm("fp32", cpu) and not emulates_gemm("bf16", torch.device("cuda", 0))
    assert (gemm_factory("bf16", cpu) is Fp32Gemm) is (not native)
    with autocast_factory("bf16", cpu)():
        assert torch.is_autocast_enabled("cpu")
        out = nn.Linear(4, 4)(torch.randn(2, 4))
    assert out.dtype == torch.bfloat16


@pytest.mark.parametrize(("arch", "precision", "compute"), [
    ("vitstr_tiny", "bf16", torch.bfloat16),  # gathered as 16-bit copies of the fp32 shards
    ("vitstr_tiny", "fp32", torch.float32),
    ("crnn_mobilenet_v3_small", "bf16", torch.float32),  # BatchNorm models keep fp32 weights, as every engine
])
def test_fsdp_gathers_weights_in_the_compute_dtype_and_keeps_fp32_shards(arch, precision, compute):
    from scale_ocr.config import ModelConfig, OptimConfig, StrategyConfig, TrainConfig
    from scale_ocr.distributed.process_group import destroy_distributed, init_distributed
    from scale_ocr.optim import build_optimizer_spec
    from scale_ocr.strategies import create_strategy
    from scale_ocr.tasks import create_task

    dist = init_distributed()  # a real one-rank gloo group
    try:
        strategy = create_strategy(StrategyConfig(strategy="fsdp"), dist, TrainConfig(precision=precision),
                                   OptimConfig())
        task = create_task(ModelConfig(arch=arch, model_width=64 if arch.startswith("vitstr") else None,
                                       model_depth=1 if arch.startswith("vitstr") else None))
        model, _ = strategy.setup(strategy.build_model(task.model_factory(), seed=0),
                                  build_optimizer_spec(OptimConfig()))
        seen = []
        linear = [m for m in model.modules() if isinstance(m, nn.Linear)][-1]  # the head: called as a module
        linear.register_forward_pre_hook(lambda m, args: seen.append(m.weight.dtype))
        with autocast_factory(precision, dist.device)():
            model(*task.dummy_inputs(2))
        assert seen == [compute]
        assert {p.dtype for p in model.parameters()} == {torch.float32}  # the shards: fp32 masters
        assert strategy.state_layout().casts_weights is (precision == "fp32")
        strategy.teardown()
    finally:
        destroy_distributed()
