"""Strategy registry and every strategy name scale-ocr ships (engines are imported inside each strategy's methods,
so listing or validating names does not import deepspeed or fairscale)."""

from scale_ocr.strategies.base import StepStats, Strategy
from scale_ocr.strategies.ddp import DDP
from scale_ocr.strategies.deepspeed import DeepSpeed
from scale_ocr.strategies.fairscale import Fairscale
from scale_ocr.strategies.fsdp import FSDP, HSDP
from scale_ocr.strategies.registry import (
    check_launch,
    create_strategy,
    list_strategies,
    register_strategy,
    strategy_entry,
)
from scale_ocr.strategies.single import DataParallel, SingleDevice

register_strategy("single", SingleDevice, "plain module on one device")
register_strategy("dp", DataParallel, "torch.nn.DataParallel: one process, all local devices (the baseline)")
register_strategy("ddp", DDP, "DistributedDataParallel: replicated model, bucketed gradient all-reduce")
register_strategy("fsdp", FSDP, "FSDP2 fully_shard per block: params, grads and optimizer state sharded",
                  reshard_after_forward=True)
register_strategy("hsdp", HSDP, "FSDP2 on a 2-D mesh: params, grads and optimizer state sharded within groups of "
                  "--shard-size ranks (default: a node's), replicated across them", reshard_after_forward=True)
register_strategy("fsdp_grad_op", FSDP, "FSDP2 without resharding after forward: grads and optimizer state "
                  "sharded (ZeRO-2-like)", reshard_after_forward=False)
for _stage, _what in (("zero1", "optimizer state"), ("zero2", "optimizer state + gradients"),
                      ("zero3", "optimizer state + gradients + parameters")):
    register_strategy(_stage, DeepSpeed, f"DeepSpeed ZeRO-{_stage[-1]}: {_what} sharded", preset=_stage)
register_strategy("zero3_hpz", DeepSpeed, "DeepSpeed ZeRO-3 with ZeRO++ hpZ: a second copy of the weights "
                  "partitioned within groups of --shard-size ranks (default: a node's), gathered from in the backward",
                  preset="zero3_hpz")
register_strategy("zero2_offload", DeepSpeed, "DeepSpeed ZeRO-2 with optimizer state offloaded to CPU",
                  preset="zero2_offload")
register_strategy("zero3_offload", DeepSpeed, "DeepSpeed ZeRO-3 with parameters and optimizer state on CPU",
                  preset="zero3_offload")
register_strategy("zero3_nvme", DeepSpeed, "DeepSpeed ZeRO-3 with parameters and optimizer state in swap files "
                  "(ZeRO-Infinity NVMe offload; needs libaio)", preset="zero3_nvme")
register_strategy("deepspeed", DeepSpeed, "DeepSpeed with the JSON given by --ds-config", preset=None)
register_strategy("fairscale", Fairscale, "fairscale OSS + ShardedDataParallel: optimizer state and grads sharded")

__all__ = ["StepStats", "Strategy", "check_launch", "create_strategy", "list_strategies", "register_strategy",
           "strategy_entry"]
