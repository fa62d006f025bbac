"""Mixed precision as autocast over fp32 weights, the same for every strategy.

On a CPU without 16-bit matrix units torch runs bf16/fp16 products through a scalar fallback, hundreds of times
slower than fp32. There the products of a low-precision run are computed by the fp32 GEMM from exactly widened
16-bit operands and rounded back (:class:`Fp32Gemm`), as a 16-bit matrix unit does (it accumulates in fp32): what the
run keeps, saves for backward and communicates stays 16-bit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
_aten = torch.ops.aten
_GEMMS = frozenset({_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default})


class Fp32Gemm(TorchDispatchMode):
    """Computes every 16-bit CPU matrix product (mm, addmm, bmm, baddbmm; forward and backward) in fp32 and
    rounds the result to the operands' dtype; every other op runs as it is."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _GEMMS:
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            dtype = tensors[0].dtype
            if dtype in _DTYPES.values() and all(t.device.type == "cpu" and t.dtype == dtype for t in tensors):
                wide = [a.float() if isinstance(a, torch.Tensor) else a for a in args]
                return func(*wide, **kwargs).to(dtype)
        return func(*args, **kwargs)


def emulates_gemm(precision: str, device: torch.device) -> bool:
    """Whether ``precision`` on ``device`` has no native 16-bit GEMM, so :class:`Fp32Gemm` computes its products."""
    if precision not in _DTYPES or device.type != "cpu":
        return False
    native = (torch.ops.mkldnn._is_mkldnn_bf16_supported if precision == "bf16"
              else torch.ops.mkldnn._is_mkldnn_fp16_supported)
    return not native()


def precision_notice(precision: str, device: torch.device) -> str | None:
    """The run's line about 16-bit products this CPU computes in fp32 (None where they run natively)."""
    if not emulates_gemm(precision, device):
        return None
    return (f"scale-ocr: this CPU has no {precision} matrix unit; {precision} matrix products are computed in fp32 "
            "from exactly widened operands and rounded back (torch's fallback is ~300x slower)")


def gemm_factory(precision: str, device: torch.device) -> Callable[[], AbstractContextManager]:
    """A zero-argument callable returning the context the forward *and* the backward run in: :class:`Fp32Gemm`
    where :func:`emulates_gemm`, nothing otherwise."""
    return Fp32Gemm if emulates_gemm(precision, device) else contextlib.nullcontext


def autocast_factory(precision: str, device: torch.device) -> Callable[[], AbstractContextManager]:
    """A zero-argument callable returning the autocast context for ``precision`` on ``device``.

    Convolutions, matmuls and the LSTM run in the low precision; autocast keeps reductions and
    BatchNorm statistics in fp32, and the CTC loss turns autocast off itself. The context includes
    :func:`gemm_factory`'s, so an evaluation's forward gets it too; a backward needs it separately.
    """
    if precision == "fp32":
        return contextlib.nullcontext
    dtype, gemm = _DTYPES[precision], gemm_factory(precision, device)

    @contextlib.contextmanager
    def autocast():
        with gemm(), torch.autocast(device_type=device.type, dtype=dtype):
            yield

    return autocast


def has_batchnorm(model: torch.nn.Module) -> bool:
    """Whether ``model`` has BatchNorm, whose weights and running statistics every engine keeps in fp32."""
    from torch.nn.modules.batchnorm import _BatchNorm

    return any(isinstance(m, _BatchNorm) for m in model.modules())


def compute_weight_dtype(precision: str, model: torch.nn.Module) -> torch.dtype | None:
    """The dtype an engine may gather or hold ``model``'s weights in for compute under ``precision``: the 16-bit
    dtype, or None for fp32 runs and for models with BatchNorm, whose weights and statistics stay fp32 under
    autocast (16-bit running statistics drift)."""
    if precision not in _DTYPES or has_batchnorm(model):
        return None
    return _DTYPES[precision]
