"""Every private or undocumented attribute of DeepSpeed's and fairscale's objects that scale_ocr reads or calls.

Checked against DeepSpeed 0.19.8 and fairscale 0.4.13 (``pyproject.toml`` bounds ``deepspeed<0.20``). Nothing
here is part of either library's API: a release may rename or drop any of it without notice. So each access is a
named function below, and :data:`PRIVATE_ATTRIBUTES` lists, once, every (class, attribute) pair those functions
rely on; each function's docstring ends with its rows of the table, and ``tests/unit/test_deepspeed_internals.py``
checks that the installed classes still have every one. A new private access is a function here and a row there.

Several functions read with ``getattr(obj, name, default)`` or ``hasattr`` because the attribute exists on some
optimizer classes (ZeRO-3, ZeRO-1/2, BF16) and not on others; the table names the class that has it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from scale_ocr.memory.meter import tensors_in

ZERO3 = "deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3"
ZERO12 = "deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer"
BF16 = "deepspeed.runtime.bf16_optimizer.BF16_Optimizer"
FP16 = "deepspeed.runtime.fp16.fused_optimizer.FP16_Optimizer"
ENGINE = "deepspeed.runtime.engine.DeepSpeedEngine"
ZERO_INIT = "deepspeed.runtime.zero.partition_parameters.Init"  # sets the ds_* attributes on each parameter
FRAGMENT = "deepspeed.utils.tensor_fragment.tensor_fragment"  # ZeRO-1/2's record of a parameter's fp32 fragment
SHARDED_DDP = "fairscale.nn.data_parallel.sharded_ddp.ShardedDataParallel"
DS_CONFIG = "deepspeed.runtime.config"  # a module: its removed-key tables


@dataclass(frozen=True)
class Private:
    """One private or undocumented attribute: ``cls`` (import path) has ``attr``, which ``used_by`` reads.

    ``attr`` is spelled as scale_ocr accesses it (a name-mangled ``__x`` of class ``C`` as ``_C__x``). It is a
    class attribute (method, property), a dataclass field, or set in the class's source (``self.attr = ...``,
    or ``param.attr = ...`` for what ``zero.Init`` attaches to parameters).
    """

    cls: str
    attr: str
    used_by: str  # a function of this module, or ``module.function`` elsewhere


PRIVATE_ATTRIBUTES: tuple[Private, ...] = (
    Private(ZERO3, "optimizer", "base_optimizer"),
    Private(ZERO12, "optimizer", "base_optimizer"),
    Private(BF16, "optimizer", "base_optimizer"),
    Private(FP16, "optimizer", "base_optimizer"),
    Private(ZERO3, "fp16_groups", "zero3_sub_group_count"),
    Private(ZERO3, "_set_fp32_optimizer_param_groups", "fp32_partitions_attached"),
    Private(ZERO3, "_clear_fp32_optimizer_param_groups", "fp32_partitions_attached"),
    Private(ZERO12, "_hp_optimizer_states_linked", "relink_hp_optimizer_state"),
    Private(ZERO12, "_lazy_init_hp_params_optimizer_state", "relink_hp_optimizer_state"),
    Private(BF16, "_hp_optimizer_states_linked", "relink_hp_optimizer_state"),
    Private(BF16, "_lazy_init_hp_params_optimizer_state", "relink_hp_optimizer_state"),
    Private(ZERO3, "_get_fp32_opt_state_partition", "fp32_partition"),
    Private(ZERO3, "_get_param_partition_rank", "zero3_partition_range"),
    Private(ZERO_INIT, "ds_tensor", "zero3_partition_range"),
    Private(ZERO_INIT, "ds_numel", "zero3_partition_range"),
    Private(ZERO12, "_hp_mapping", "hp_fragment"),
    Private(BF16, "_hp_mapping", "hp_fragment"),
    Private(FRAGMENT, "lp_fragment_address", "hp_fragment"),
    Private(FRAGMENT, "get_hp_fragment", "hp_fragment"),
    Private(ENGINE, "skipped_steps", "skipped_steps"),
    Private(ZERO12, "gradient_accumulation_steps", "set_accumulation"),
    Private(ZERO3, "gradient_accumulation_steps", "set_accumulation"),
    Private(ZERO3, "cur_scale", "loss_scale"),
    Private(ZERO12, "cur_scale", "loss_scale"),
    Private(ZERO3, "averaged_gradients", "grad_partitions"),
    Private(ZERO12, "averaged_gradients", "grad_partitions"),
    Private(ZERO12, "grads_in_partition", "grad_partitions"),
    Private(ZERO3, "grad_partitions_flat_buffer", "grad_partitions"),
    Private(ZERO3, "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition", "grad_partitions"),
    Private(ZERO12, "offload_gradient_dict", "grad_partitions"),
    Private(ZERO12, "single_partition_of_fp32_groups", "fp32_master_partitions"),
    Private(ZERO3, "fp32_partitioned_groups_flat", "fp32_master_partitions"),
    Private(ZERO3, "ipg_buckets", "reduce_bucket_buffers"),
    Private(ZERO12, "ipg_buckets", "reduce_bucket_buffers"),
    Private("deepspeed.runtime.zero.stage3.IPGBucketZ3", "buffer", "reduce_bucket_buffers"),
    Private("deepspeed.runtime.zero.stage_1_and_2.IPGBucket", "buffer", "reduce_bucket_buffers"),
    Private(ZERO_INIT, "nvme_swapper", "nvme_staging_buffers"),
    Private("deepspeed.runtime.swap_tensor.partitioned_param_swapper.AsyncPartitionedParameterSwapper", "buffers",
            "nvme_staging_buffers"),
    Private(ZERO3, "optimizer_swapper", "nvme_staging_buffers"),
    Private("deepspeed.runtime.swap_tensor.optimizer_utils.OptimizerSwapper", "swap_buffer_manager",
            "nvme_staging_buffers"),
    Private("deepspeed.runtime.swap_tensor.utils.SwapBufferManager", "all_buffers", "nvme_staging_buffers"),
    Private(ZERO_INIT, "ds_tensor", "param_partition"),
    Private(ZERO_INIT, "ds_secondary_tensor", "param_secondary_partition"),
    # Read directly by scale_ocr.models.init (full_shape, full_numel); listed so the test guards them too.
    Private(ZERO_INIT, "ds_shape", "scale_ocr.models.init.full_shape"),
    Private(ZERO_INIT, "ds_numel", "scale_ocr.models.init.full_numel"),
    # A module's private names, not a class's: the keys DeepSpeed removed, each with its reason.
    Private(DS_CONFIG, "_REMOVED_TOP_LEVEL_CONFIG_KEYS", "removed_config_keys"),
    Private(DS_CONFIG, "_REMOVED_ZERO_CONFIG_KEYS", "removed_config_keys"),
    Private(SHARDED_DDP, "_bucket_list", "ddp_bucket_buffers"),
    Private("fairscale.nn.misc.param_bucket.GradBucket", "buffer", "ddp_bucket_buffers"),
)

F = TypeVar("F", bound=Callable[..., Any])


def _relies_on(fn: F) -> F:
    """Append ``fn``'s rows of :data:`PRIVATE_ATTRIBUTES` to its docstring."""
    rows = [f"``{p.cls}.{p.attr}``" for p in PRIVATE_ATTRIBUTES if p.used_by == fn.__name__]
    fn.__doc__ = (fn.__doc__ or "").rstrip() + "\n\n    Relies on: " + ", ".join(rows) + "."
    return fn


# --- DeepSpeed: the optimizer and its state --------------------------------------------------------------------

@_relies_on
def base_optimizer(engine_optimizer: Any) -> Any:
    """The torch optimizer DeepSpeed's ZeRO/BF16/FP16 wrapper steps over its flat fp32 partitions (itself when
    DeepSpeed did not wrap it)."""
    return getattr(engine_optimizer, "optimizer", engine_optimizer)


@_relies_on
def zero3_sub_group_count(zero_opt: Any) -> int:
    """How many sub-groups ZeRO-3 steps one at a time (0 for other optimizers)."""
    return len(getattr(zero_opt, "fp16_groups", ()))


@_relies_on
@contextlib.contextmanager
def fp32_partitions_attached(zero_opt: Any) -> Iterator[None]:
    """ZeRO-3 attaches its fp32 partitions to the base optimizer's param groups only while it steps: attach them
    for the ``with`` block (to create or read the optimizer's state), detach after. Nothing for other stages."""
    if not hasattr(zero_opt, "_set_fp32_optimizer_param_groups"):
        yield
        return
    zero_opt._set_fp32_optimizer_param_groups()
    try:
        yield
    finally:
        zero_opt._clear_fp32_optimizer_param_groups()


@_relies_on
def relink_hp_optimizer_state(zero_opt: Any) -> None:
    """Point ZeRO-1/2's (and BF16's) per-parameter fragments at the optimizer state now, not at the first step
    (which links them lazily). Nothing for optimizers without fragments."""
    if hasattr(zero_opt, "_hp_optimizer_states_linked"):
        zero_opt._hp_optimizer_states_linked = False
        zero_opt._lazy_init_hp_params_optimizer_state()


@_relies_on
def fp32_partition(zero3_opt: Any, param: torch.nn.Parameter, key: str | None = None,
                   release: bool = False) -> torch.Tensor:
    """ZeRO-3: this rank's (padded) partition of ``param``'s fp32 master (``key=None``) or of its optimizer state
    ``key``, a view of the optimizer's flat buffer. ``release``: under NVMe offload, give the swap buffer back at once
    (the view is then valid only until the next swap: read it before asking for another)."""
    return zero3_opt._get_fp32_opt_state_partition(param, release_swap_buffers=release, optim_state_key=key)[0]


@_relies_on
def zero3_partition_range(zero3_opt: Any, param: torch.nn.Parameter) -> tuple[int, int]:
    """ZeRO-3: where this rank's partition of ``param`` starts in its flat order, and its (padded) size: the ranks'
    partitions are equal, in rank order, and the last pads past the parameter's end."""
    size = param.ds_tensor.ds_numel
    return size * zero3_opt._get_param_partition_rank(param), size


def holds_fragments(param: torch.nn.Parameter) -> bool:
    """Whether a ZeRO-1/2 (or BF16) optimizer records ``param``'s fp32 fragments (see :func:`hp_fragment`)."""
    return hasattr(param, "_hp_mapping")


@_relies_on
def hp_fragment(param: torch.nn.Parameter, key: str | None = None) -> tuple[torch.Tensor, int] | None:
    """ZeRO-1/2 (and the BF16 optimizer): this rank's fragment of ``param``'s fp32 master (``key=None``) or of its
    optimizer state ``key`` (a view of the flat partition), and where it starts in ``param``'s flat order; None when
    this rank's partition holds none of ``param``."""
    mapping = param._hp_mapping
    if mapping is None:
        return None
    return mapping.get_hp_fragment(key), mapping.lp_fragment_address.start


@_relies_on
def loss_scale(zero_opt: Any) -> float:
    """The ZeRO optimizer's current fp16 loss scale."""
    return float(zero_opt.cur_scale)


# --- DeepSpeed: the engine -------------------------------------------------------------------------------------

@_relies_on
def skipped_steps(engine: Any) -> int:
    """How many optimizer steps the engine skipped (fp16 overflow) so far."""
    return engine.skipped_steps


@_relies_on
def set_accumulation(engine: Any, micro_batches: int) -> None:
    """Accumulate ``micro_batches`` per step from the next one: the engine's own setter (public: it rewrites its
    config's train_batch_size and gradient_accumulation_steps, which its backward divides by and its boundary counts
    to), and the ZeRO optimizer's copy, which ZeRO-1/2 read with CPU offload to decide whether to accumulate its
    host gradients."""
    engine.set_train_batch_size(engine.train_micro_batch_size_per_gpu() * engine.dp_world_size * micro_batches)
    if hasattr(engine.optimizer, "gradient_accumulation_steps"):
        engine.optimizer.gradient_accumulation_steps = micro_batches


# --- DeepSpeed: the tensors a rank holds, for scale_ocr.memory's meter ----------------------------------------

@_relies_on
def param_partition(param: torch.nn.Parameter) -> torch.Tensor:
    """ZeRO-3: this rank's partition of ``param``; ``param`` itself when it is not partitioned."""
    return getattr(param, "ds_tensor", param)


@_relies_on
def param_secondary_partition(param: torch.nn.Parameter) -> torch.Tensor | None:
    """ZeRO++ hpZ: this rank's secondary partition of ``param``, over its hpZ group (a node), from which the
    backward gathers; None without hpZ, or while ZeRO-3 keeps ``param`` whole (persistent small parameters)."""
    return getattr(param, "ds_secondary_tensor", None)


@_relies_on
def grad_partitions(zero_opt: Any) -> list[torch.Tensor]:
    """The gradient partitions and buffers a ZeRO optimizer keeps (those it has at the moment)."""
    names = ("averaged_gradients", "grads_in_partition", "grad_partitions_flat_buffer",
             "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition", "offload_gradient_dict")
    return [t for name in names for t in tensors_in(getattr(zero_opt, name, None))]


@_relies_on
def fp32_master_partitions(zero_opt: Any) -> list[torch.Tensor]:
    """Every fp32 master partition of a ZeRO optimizer (ZeRO-3: of all sub-groups, not only the stepping one)."""
    names = ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat")
    return [t for name in names for t in tensors_in(getattr(zero_opt, name, None))]


def attribute_tensors(obj: Any, depth: int = 2) -> list[torch.Tensor]:
    """Every tensor in ``obj``'s attributes (in lists and dicts down to ``depth``), whatever their names."""
    return [t for v in vars(obj).values() for t in tensors_in(v, depth)]


@_relies_on
def reduce_bucket_buffers(zero_opt: Any) -> list[torch.Tensor]:
    """ZeRO's gradient reduce buckets (allocated up front)."""
    return [t for bucket in getattr(zero_opt, "ipg_buckets", {}).values()
            for t in tensors_in(getattr(bucket, "buffer", None))]


@_relies_on
def nvme_staging_buffers(params: Iterable[torch.nn.Parameter], zero_opt: Any) -> list[torch.Tensor]:
    """NVMe offload's pinned staging buffers: the parameter swapper's (one per swapper the parameters share), then
    the optimizer swapper's."""
    staging = []
    for swapper in {id(s): s for p in params if (s := getattr(p, "nvme_swapper", None)) is not None}.values():
        staging += list(tensors_in(getattr(swapper, "buffers", None)))
    manager = getattr(getattr(zero_opt, "optimizer_swapper", None), "swap_buffer_manager", None)
    staging += list(tensors_in(getattr(manager, "all_buffers", None)))
    return staging


# --- DeepSpeed: its JSON -----------------------------------------------------------------------------------------

@_relies_on
def removed_config_keys() -> tuple[dict[str, str], dict[str, str]]:
    """The top-level and ``zero_optimization`` keys DeepSpeed removed and refuses, each with DeepSpeed's reason."""
    from deepspeed.runtime import config

    return dict(config._REMOVED_TOP_LEVEL_CONFIG_KEYS), dict(config._REMOVED_ZERO_CONFIG_KEYS)


# --- fairscale -------------------------------------------------------------------------------------------------

@_relies_on
def ddp_bucket_buffers(sharded_ddp: Any) -> list[torch.Tensor]:
    """ShardedDataParallel's gradient reduce buckets (``.grad`` tensors are views into them)."""
    return [b.buffer for b in sharded_ddp._bucket_list]
