"""Training FLOPs per sample, counted by torch's own counter (:class:`torch.utils.flop_counter.FlopCounterMode`).

One forward and backward of a batch of 2 at the run's input size, divided by 2, counting the multiply-adds of
matrix products, convolutions, attention and recurrent layers (2 FLOPs each). Three of torch's rules are completed
here, each checked against a hand count (tests/unit/test_flops.py): grouped convolutions' weight gradient (torch
ignores ``groups``), CPU and cuDNN LSTMs (torch counts neither), and CPU flash attention (missing from its table).
Models are counted on the meta device, or on the CPU when their forward reads values (docTR's). Activation
checkpointing's recomputation is not model FLOPs (PaLM's MFU convention).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode, conv_flop_count, sdpa_backward_flop_count, sdpa_flop_count

aten = torch.ops.aten
COUNT_BATCH = 2  # samples counted at once (BatchNorm refuses one sample of a 1x1 feature map); counts are per sample


@dataclass(frozen=True)
class FlopCount:
    """FLOPs of one training sample.

    Attributes:
        forward: the forward's FLOPs.
        backward: the backward's (input and weight gradients; about twice the forward).
        how: how they were counted: ``"meta"`` (shapes only) or ``"cpu"`` (a real forward and backward).
    """

    forward: int
    backward: int
    how: str = "meta"

    @property
    def total(self) -> int:
        """Forward plus backward: one training step's FLOPs per sample (MFU's numerator per sample)."""
        return self.forward + self.backward


def _conv_backward(grad_out_shape, x_shape, w_shape, _bias, _stride, _padding, _dilation, transposed,
                   _output_padding, groups, output_mask, out_shape=None, **kwargs) -> int:
    """torch's ``convolution_backward`` rule with the weight gradient divided by ``groups`` (see the module doc)."""
    def t(shape):
        return [shape[1], shape[0], *shape[2:]]

    count = 0
    if output_mask[0]:  # the input gradient: a transposed convolution with the same weight; torch's is right
        count += conv_flop_count(grad_out_shape, w_shape, out_shape[0], not transposed)
    if output_mask[1]:  # the weight gradient: each output channel meets only its group's input channels
        if transposed:
            full = conv_flop_count(t(grad_out_shape), t(x_shape), t(out_shape[1]), transposed=False)
        else:
            full = conv_flop_count(t(x_shape), t(grad_out_shape), t(out_shape[1]), transposed=False)
        count += full // groups
    return count


def _rnn_products(tokens: int, weights: Sequence[Any]) -> int:
    """Gate products of a recurrent layer over ``tokens`` steps x batch: 2 FLOPs per weight of each 2-D matrix."""
    return 2 * tokens * sum(w[0] * w[1] for w in weights if w is not None and len(w) == 2)


def _tokens(input_shape) -> int:
    """Time steps x batch of an RNN input, (T, B, I), (B, T, I) or packed (sum of T, I)."""
    n = 1
    for d in input_shape[:-1]:
        n *= d
    return n


def _mkldnn_rnn(input_shape, w_ih, w_hh, *args, out_shape=None, **kwargs) -> int:
    """One layer and direction of a CPU LSTM/GRU/RNN (``mkldnn_rnn_layer``)."""
    return _rnn_products(_tokens(input_shape), [w_ih, w_hh])


def _mkldnn_rnn_backward(input_shape, w_ih, w_hh, *args, out_shape=None, **kwargs) -> int:
    """Its backward: the input gradient and the weight gradient, each as many products as the forward."""
    return 2 * _mkldnn_rnn(input_shape, w_ih, w_hh)


def _cudnn_rnn(input_shape, weights, *args, out_shape=None, **kwargs) -> int:
    """A whole cuDNN RNN stack (``_cudnn_rnn``): every layer and direction's matrices over every token."""
    return _rnn_products(_tokens(input_shape), weights)


def _cudnn_rnn_backward(input_shape, weights, *args, out_shape=None, **kwargs) -> int:
    return 2 * _cudnn_rnn(input_shape, weights)


def _cpu_attention(q_shape, k_shape, v_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(q_shape, k_shape, v_shape)


def _cpu_attention_backward(grad_out_shape, q_shape, k_shape, v_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out_shape, q_shape, k_shape, v_shape)


def _rules() -> dict[Any, Callable[..., int]]:
    """The rules that complete torch's table (see the module doc); an operator this torch lacks is skipped."""
    named = {"convolution_backward": _conv_backward, "mkldnn_rnn_layer": _mkldnn_rnn,
             "mkldnn_rnn_layer_backward": _mkldnn_rnn_backward, "_cudnn_rnn": _cudnn_rnn,
             "_cudnn_rnn_backward": _cudnn_rnn_backward, "miopen_rnn": _cudnn_rnn,
             "miopen_rnn_backward": _cudnn_rnn_backward,
             "_scaled_dot_product_flash_attention_for_cpu": _cpu_attention,
             "_scaled_dot_product_flash_attention_for_cpu_backward": _cpu_attention_backward}
    return {getattr(aten, name): rule for name, rule in named.items() if hasattr(aten, name)}


def counter() -> FlopCounterMode:
    """torch's FLOP counter with the completed rules: ``with counter() as c: ...; c.get_total_flops()``."""
    return FlopCounterMode(display=False, custom_mapping=_rules())


def _grad_leaves(out: Any) -> list[torch.Tensor]:
    """Every tensor in a model's output (tensor, dict, list or tuple) that gradients flow back through."""
    if torch.is_tensor(out):
        return [out] if out.requires_grad else []
    values = out.values() if isinstance(out, dict) else out if isinstance(out, (list, tuple)) else ()
    return [t for v in values for t in _grad_leaves(v)]


def count_flops(model: nn.Module, inputs: Sequence[Any], backward: Callable[[Any], None] | None = None,
                batch: int = COUNT_BATCH) -> tuple[int, int]:
    """Forward and backward FLOPs per sample of ``model(*inputs)``, a batch of ``batch`` samples.

    Args:
        model: the model, in training mode (on any device, the meta device included).
        inputs: its arguments.
        backward: runs the backward from the output; default: from every output that needs a gradient, with a
            gradient of ones (the counted FLOPs do not depend on the gradient's values, only on its shape).
        batch: samples in ``inputs``.
    """
    with counter() as c:
        out = model(*inputs)
        forward = c.get_total_flops()
        if backward is not None:
            backward(out)
        else:
            leaves = _grad_leaves(out)
            torch.autograd.backward(leaves, [torch.ones_like(t) for t in leaves])
        total = c.get_total_flops()
    model.zero_grad(set_to_none=True)
    return forward // batch, (total - forward) // batch


def _on_meta(create: Callable[[], nn.Module], inputs: Callable[[int], Sequence[Any]]) -> FlopCount:
    """Shapes only: the bare model on the meta device, fed its images (a loss adds no counted FLOPs)."""
    with torch.device("meta"):
        model = create().train()
        images = inputs(COUNT_BATCH)[0]
    return FlopCount(*count_flops(model, [images]), how="meta")


def _on_cpu(create: Callable[[], nn.Module], inputs: Callable[[int], Sequence[Any]], precision: str) -> FlopCount:
    """A real forward, loss and backward on the CPU at the run's precision (models whose forward reads values)."""
    from scale_ocr.precision import autocast_factory, gemm_factory

    cpu = torch.device("cpu")
    with torch.random.fork_rng():  # the run's own random stream is left as it was
        torch.manual_seed(0)
        model = create().train()
        batch = inputs(COUNT_BATCH)
    autocast, gemm = autocast_factory(precision, cpu), gemm_factory(precision, cpu)
    with autocast():
        fwd, bwd = count_flops(model, batch, lambda out: _backward_loss(out, gemm))
    return FlopCount(fwd, bwd, how="cpu")


def _backward_loss(out: dict[str, torch.Tensor], gemm) -> None:
    with gemm():
        out["loss"].mean().backward()


def flops_per_sample(create: Callable[[], nn.Module], inputs: Callable[[int], Sequence[Any]],
                     precision: str = "fp32") -> FlopCount:
    """Forward and backward FLOPs of one training sample of the model ``create`` builds.

    Args:
        create: builds the bare model (a task's ``create_model``: the run's architecture, size and vocabulary).
        inputs: a training batch of ``n`` samples as the model's arguments (a task's ``dummy_inputs``).
        precision: ``"fp32"``, ``"bf16"`` or ``"fp16"``. The counted FLOPs do not depend on it; it picks the
            kernels a model counted on the CPU runs.

    Returns:
        a :class:`FlopCount` per sample: counted on the meta device, or, for a forward that reads values, on the CPU.
    """
    try:
        return _on_meta(create, inputs)
    except (RuntimeError, NotImplementedError, ValueError, TypeError, KeyError):
        # A forward that reads a value (a meta tensor has none) or insists on its targets: count it for real.
        return _on_cpu(create, inputs, precision)
