"""``zero1`` ... ``zero3_offload`` and ``deepspeed``: the DeepSpeed engine with a ZeRO JSON."""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

from torch import nn

from scale_ocr.errors import UserError, first_line, say
from scale_ocr.memory.meter import StateMeter, optimizer_tensors
from scale_ocr.memory.model import StateLayout
from scale_ocr.models.init import ModelFactory, full_numel, init_weights
from scale_ocr.optim import OptimizerSpec
from scale_ocr.strategies import deepspeed_internals as internals
from scale_ocr.strategies.base import (
    ModelPiece,
    StepStats,
    Strategy,
    hook_tensors,
    single_group_notice,
    tensor_norm,
    with_buffers,
)
from scale_ocr.strategies.common import broadcast_buffers
from scale_ocr.strategies.deepspeed_state import DeepSpeedState
from scale_ocr.strategies.ds_config import keep_fp32_weights, load_ds_config, preset_path, resolve_ds_config
from scale_ocr.strategies.nvme import check_async_io, nvme_sections, prepare_swap, remove_swap, swap_bytes


class DeepSpeed(Strategy):
    """DeepSpeed's engine, configured by the JSON (``preset``: a ``ds_configs/`` name used without ``--ds-config``).
    It owns accumulation, clipping and fp16 loss scaling; the same flags mean the same maths as under DDP or FSDP."""

    shards_state = True
    reads_ds_config = True
    changes_accumulation = True

    @classmethod
    def takes_shard_size(cls, cfg, **preset) -> bool:
        """When the JSON has ``zero_optimization.zero_hpz_partition_size`` (ZeRO++ hpZ, the zero3_hpz preset)."""
        source = cfg.ds_config or (str(preset_path(preset["preset"])) if preset.get("preset") else None)
        zero = load_ds_config(source).get("zero_optimization") if source else None
        return isinstance(zero, dict) and "zero_hpz_partition_size" in zero

    def __init__(self, *args, preset: str | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.cfg.ds_config:
            self.source = self.cfg.ds_config
        elif preset:
            self.source = str(preset_path(preset))
        else:
            raise UserError("--strategy deepspeed needs --ds-config PATH; or pick a preset such as zero2")
        self.fp32_for_batchnorm = False  # set by configure_for()
        self.raw_config = load_ds_config(self.source)
        # NVMe offload's "auto" path is the run's own folder (another run's swap files are never touched);
        # without a run directory (a strategy built to be described) a per-process temporary one.
        own_swap = (self.run_dir / "nvme" if self.run_dir is not None
                    else Path(tempfile.gettempdir()) / f"scale-ocr-nvme-{os.getpid()}")
        self.ds_config = resolve_ds_config(
            self.raw_config, source=self.source, micro_batch=self.train.batch_size,
            grad_accum=self.train.grad_accum, world_size=self.world_size, clip_grad=self.optim.clip_grad,
            precision=self.train.precision, lr=self.optim.peak_lr, weight_decay=self.optim.wd,
            nvme_path=self.cfg.nvme_path, nvme_default=str(own_swap), device_type=self.dist.device.type,
            shard_size=self.cfg.shard_size, local_world=self.dist.local_world_size,
        )
        self.nvme_paths = sorted({Path(s["nvme_path"]) for s in nvme_sections(self.ds_config)})
        self._own_swap = [own_swap] if self.cfg.nvme_path is None and own_swap in self.nvme_paths else []
        self._swap_ready = False
        self._shm_unlinked = False
        self._loop_boundary = False  # set_accumulation: the loop, not the engine's counter, marks each step's end

    def _prepare_swap(self) -> None:
        """Before the engine first swaps (zero.Init or initialize): the op loads and this rank's folders are empty."""
        if self.nvme_paths and not self._swap_ready:
            check_async_io()
            prepare_swap(self.nvme_paths, self.rank)
            self._swap_ready = True

    def _init_comm(self) -> None:
        """DeepSpeed's communication layer over our process group. On CPU hosts its all-reduce maps one ``/dev/shm``
        file per rank and never removes it: once every rank has mapped every file, each unlinks its own, and the
        memory is freed when the last process holding the mapping exits, however it exits."""
        import deepspeed

        deepspeed.init_distributed(dist_backend=self.dist.backend, auto_mpi_discovery=False, dist_init_required=False)
        if not self._shm_unlinked:
            release_shm_buffer(self.rank)
            self._shm_unlinked = True

    def configure_for(self, model: nn.Module) -> None:
        self.fp32_for_batchnorm = keep_fp32_weights(self.ds_config, self.raw_config, model)

    def build_model(self, factory: ModelFactory, seed: int) -> nn.Module:
        """Under ZeRO-3, a model with a per-parameter init rule is built inside ``deepspeed.zero.Init`` (no rank holds
        it whole), then each parameter is gathered in turn and set from ``(seed, name)``; others are built whole."""
        if self.ds_config.get("zero_optimization", {}).get("stage", 0) != 3 or factory.meta_with_rule() is None:
            return super().build_model(factory, seed)
        import deepspeed

        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
        self._prepare_swap()
        self._init_comm()  # deepspeed.initialize would wrap our process group later; zero.Init needs it now
        with deepspeed.zero.Init(config_dict_or_path=self.ds_config):
            model = factory.create()  # wrappers (activation checkpointing) are not built under zero.Init
        init_weights(model, seed, gathered=lambda p: deepspeed.zero.GatheredParameters([p], modifier_rank=0))
        return factory.apply_options(model)

    def setup(self, model: nn.Module, optimizer: OptimizerSpec) -> tuple[nn.Module, Any]:
        if optimizer.layerwise:  # before the engine starts: every rank refuses alike
            refuse_flattened(self.ds_config, self.source, optimizer.cls.__name__)
        import deepspeed

        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
        self._prepare_swap()
        self.configure_for(model)
        hpz = self._hpz_group()
        line = single_group_notice(self.cfg.strategy, hpz, self.world_size, "zero3 plus a copy of each partition")
        if hpz > 1 and line and self.is_main:
            say(line)
        if self.fp32_for_batchnorm and self.is_main:
            say("scale-ocr: DeepSpeed keeps fp32 weights (under autocast) for this BatchNorm model; "
                "set \"bf16\": {\"enabled\": true} in the JSON to force 16-bit weights")
        model = model.to(self.dist.device)
        self._init_comm()
        kwargs: dict[str, Any] = {"model": model, "config": self.ds_config, "dist_init_required": False}
        if "optimizer" in self.ds_config:
            kwargs["model_parameters"] = optimizer.groups(model)
            self._client_groups = kwargs["model_parameters"]
        else:
            kwargs["optimizer"] = optimizer.build(model)
            self._client_groups = [dict(g, params=list(g["params"])) for g in kwargs["optimizer"].param_groups]
        try:
            self.engine, self.optimizer, _, _ = deepspeed.initialize(**kwargs)
        except (AssertionError, ValueError, TypeError, KeyError) as exc:
            first = first_line(exc)
            raise UserError(f"DeepSpeed rejected {self.source}: {first}") from None
        self.zero_stage = self.engine.zero_optimization_stage()
        self.state = DeepSpeedState(self.engine, self._client_groups, self.is_main)
        disk = (lambda: swap_bytes(self.nvme_paths, self.rank)) if self.nvme_paths else None
        calls = internals.zero3_sub_group_count(self.engine.optimizer) if self.zero_stage == 3 else 1  # per sub-group
        self.meter = StateMeter(self._base_optimizer(), self._state_tensors, self.dist.device,
                                samples=2 * max(1, calls), disk=disk)
        return self.engine, self.optimizer

    def _state_tensors(self) -> dict[str, list]:
        """What this rank holds, as DeepSpeed lays it out, by the categories of :mod:`scale_ocr.memory.meter`."""
        zero_opt, base = self.engine.optimizer, self._base_optimizer()
        params = list(self.engine.module.parameters())
        masters = [p for g in base.param_groups for p in g["params"]]  # ZeRO-3: only the sub-group stepping
        masters += internals.fp32_master_partitions(zero_opt)  # every master partition
        # Their gradients too: an offloaded ZeRO-3 optimizer keeps one fp32 gradient buffer per sub-group, not only
        # the stepping one's (the base optimizer's groups hold one sub-group at a time).
        grads = [p.grad for p in params] + [p.grad for p in masters] + internals.grad_partitions(zero_opt)
        other = internals.attribute_tensors(zero_opt) if zero_opt is not base else []
        other += internals.reduce_bucket_buffers(zero_opt)  # reduce buckets, allocated up front
        # NVMe offload's pinned staging buffers (the parameter and the optimizer swapper's) are "other" whatever
        # they hold at the moment: the state swapped into them is counted on disk, so categories do not depend
        # on which sub-group happens to be stepping when the meter samples.
        staging = internals.nvme_staging_buffers(params, zero_opt)
        in_staging = {t.untyped_storage().data_ptr() for t in staging}

        def held(tensors: list) -> list:
            return [t for t in tensors if t is None or t.untyped_storage().data_ptr() not in in_staging]

        partitions = [internals.param_partition(p) for p in params] + [internals.param_secondary_partition(p)
                                                                       for p in params]  # hpZ's in-node copy
        return {"params": held(partitions), "grads": held(grads),
                "optimizer": held(masters + optimizer_tensors(base)), "other": staging + other}

    def state_layout(self) -> StateLayout:
        zero = self.ds_config.get("zero_optimization", {})
        stage = int(zero.get("stage", 0))
        mixed = bool(self.ds_config["bf16"]["enabled"] or self.ds_config["fp16"]["enabled"])
        weight = 2 if mixed else 4
        opt_dev = zero.get("offload_optimizer", {}).get("device", "none")
        par_dev = zero.get("offload_param", {}).get("device", "none")
        off_opt = opt_dev in ("cpu", "nvme")

        def where(device: str) -> str:  # the parts offloaded to ``device``, as StateLayout names them
            parts = [name for name, d in (("optimizer", opt_dev), ("params", par_dev)) if d == device]
            return "+".join(parts)
        # Offloaded ZeRO-1/2 keeps only the fp32 gradient partition (on the host), no 16-bit one.
        grad_bytes = 0 if (off_opt and stage < 3) else weight
        bucket = int(zero.get("reduce_bucket_size", 5e8)) * weight if stage == 3 else 0
        if par_dev == "nvme":  # pinned staging buffers, whatever the model size (DeepSpeed's defaults: 5 x 1e8)
            off = zero["offload_param"]
            bucket += int(off.get("buffer_count", 5)) * int(off.get("buffer_size", 1e8)) * weight
        if opt_dev == "nvme":  # about a sub-group of fp32 each (its largest, if one parameter is bigger)
            bucket += int(zero["offload_optimizer"].get("buffer_count", 4)) * int(zero.get("sub_group_size", 1e9)) * 4
        note = ("an fp32 master partition beside the 16-bit weights" if mixed
                else "clones an fp32 master partition although the weights are fp32")
        note += "; the gradient partition is upcast to fp32 for the step"
        if stage == 3 and off_opt:
            note += (", the whole partition, kept beside the offloaded optimizer"
                     + ("; at the boundary it is built in device memory, then swapped out" if opt_dev == "nvme" else "")
                     + f"; a reduce bucket of reduce_bucket_size ({zero.get('reduce_bucket_size', 5e8):.0e}) elements "
                     "is allocated up front")
        elif stage == 3:
            note += (f", one sub-group ({zero.get('sub_group_size', 1e9):.0e} elements) at a time; a reduce bucket "
                     f"of reduce_bucket_size ({zero.get('reduce_bucket_size', 5e8):.0e}) elements is allocated up "
                     "front")
        if where("nvme"):
            note += ("; NVMe offload: swap files hold the offloaded state (parameter partitions under 1 MiB stay "
                     "in memory), host memory a sub-group and buffer_count x buffer_size staging buffers")
        hpz = self._hpz_group()
        if hpz > 1:
            note += (f"; ZeRO++ hpZ: a second copy of the weights partitioned over groups of {hpz} ranks (a node), "
                     "from which the backward gathers; DeepSpeed's own estimate leaves it out")
        # An offloaded ZeRO-3 optimizer keeps the whole fp32 gradient partition (pinned host buffers, or swap files
        # that NVMe offload first fills from memory at the boundary) and the 16-bit one on the host (stage3.py).
        chunk = int(zero.get("sub_group_size", 1e9)) if stage == 3 and not off_opt else None
        host = where("cpu") + ("+grads" if stage == 3 and off_opt else "")
        return StateLayout(ideal_stage=stage, mixed=mixed, param_bytes=weight, params_sharded=stage == 3,
                           secondary_group=hpz if hpz > 1 else 0,
                           grad_bytes=grad_bytes, grads_sharded=True, step_grad_bytes=4, step_grad_chunk=chunk,
                           master_bytes=4, optim_sharded=True, buffer_bytes=bucket, host=host.lstrip("+"),
                           disk=where("nvme"), grads_staged=opt_dev == "nvme",
                           gathers_per="module" if stage == 3 else "", note=note)

    def _hpz_group(self) -> int:
        """ZeRO++ hpZ's group size (the resolved ``zero_hpz_partition_size``), 1 when hpZ is off."""
        zero = self.ds_config.get("zero_optimization", {})
        return int(zero.get("zero_hpz_partition_size", 1)) if zero.get("stage") == 3 else 1

    def engine_config(self) -> dict[str, Any]:
        return self.ds_config

    def no_sync(self):
        # The engine decides itself which micro-steps reduce (ZeRO-2/3 reduce into partitions on
        # every micro-step to free memory); its own no_sync() refuses gradient partitioning.
        return self._accumulating() if self._loop_boundary else contextlib.nullcontext()

    @contextlib.contextmanager
    def _accumulating(self):
        """A micro-step that is not the step's last, told to the engine (after :meth:`set_accumulation`)."""
        self.engine.set_gradient_accumulation_boundary(False)
        try:
            yield
        finally:
            self.engine.set_gradient_accumulation_boundary(True)

    def set_accumulation(self, micro_batches: int) -> None:
        # The engine finds its boundary by counting micro-steps since it started, modulo the accumulation: after a
        # change that count no longer starts at a step's first micro-batch, so from then on the loop says which
        # micro-step is a step's last (no_sync, around every other one).
        internals.set_accumulation(self.engine, micro_batches)
        self._loop_boundary = True

    def backward(self, loss) -> None:
        self.engine.backward(loss)
        if not self.engine.is_gradient_accumulation_boundary():
            # engine.step() on a non-boundary micro-step only advances the engine's micro-step
            # counter, keeping its notion of the accumulation boundary aligned with the loop's.
            self.engine.step()

    def tap_gradients(self, on_grad):
        # ZeRO-3 gathers each weight into the module's own parameter for the forward, so those are what the backward
        # differentiates at every stage; the engine's own hooks (reduce, partition) run after these.
        return hook_tensors(self.engine.module.parameters(), on_grad)

    def gradient_scale(self) -> float:
        scale = internals.loss_scale(self.optimizer) if self.engine.fp16_enabled() else 1.0
        return float(scale) / self.engine.gradient_accumulation_steps()  # engine.backward divides by it

    def step(self) -> StepStats:
        skipped_before = internals.skipped_steps(self.engine)
        # Stage 0 in fp32 steps the client optimizer on the module's own (all-reduced) gradients and keeps no norm.
        plain = not (self.zero_stage or self.engine.fp16_enabled() or self.engine.bfloat16_enabled())
        own = tensor_norm([p.grad for p in self.engine.module.parameters() if p.grad is not None]) if plain else None
        self.engine.step()
        norm = self.engine.get_global_grad_norm() if own is None else own
        fp16 = self.engine.fp16_enabled()
        return StepStats(
            grad_norm=float(norm) if norm is not None else float("nan"),
            skipped=internals.skipped_steps(self.engine) > skipped_before,
            loss_scale=internals.loss_scale(self.optimizer) if fp16 else None,
        )

    def weight_norm(self):
        """With the floating buffers (:func:`with_buffers`). ZeRO-3: the squares of this rank's partitions summed over
        the ranks, without the last one's padding, which DeepSpeed leaves uninitialized (it would make the norm NaN now
        and then); None under NVMe parameter offload."""
        import torch.distributed as tdist

        params = [p for p in self.engine.module.parameters() if p.requires_grad]
        if self.zero_stage < 3:
            return with_buffers(tensor_norm(params), self.engine.module)
        if self.ds_config.get("zero_optimization", {}).get("offload_param", {}).get("device") == "nvme":
            return None  # decided by the config, never by tensors, so every rank takes the same branch
        parts = []
        for p in params:
            start, size = internals.zero3_partition_range(self.engine.optimizer, p)
            parts.append(internals.param_partition(p).view(-1)[: max(0, min(size, full_numel(p) - start))])
        square = tensor_norm(parts).float().square().reshape(1).to(self.dist.device)
        if tdist.is_initialized():
            tdist.all_reduce(square)
        return with_buffers(square.sqrt()[0], self.engine.module)  # buffers: whole on every rank, never summed

    def sync_buffers(self) -> None:
        broadcast_buffers(self.engine.module)  # as DDP: one set of BatchNorm statistics, rank 0's

    def _base_optimizer(self):
        """The torch optimizer DeepSpeed steps over its flat fp32 partitions."""
        return internals.base_optimizer(self.engine.optimizer)

    def checkpoint_state(self) -> dict[str, Any]:
        """Each rank's part of every fp32 master and Adam moment, where it lies, in the layout every strategy shares
        (ZeRO's own checkpoints only reopen under the same stage and world size)."""
        return self.state.checkpoint_state()

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        """``state`` was read into DeepSpeed's buffers in place (see :meth:`checkpoint_load_target`); the 16-bit
        weights follow from the masters."""
        self.state.finish_load(state)

    def checkpoint_load_target(self) -> dict[str, Any]:
        return self.state.checkpoint_state(to_load=True)

    def model_pieces(self) -> list[ModelPiece]:
        return self.state.model_pieces()

    def teardown(self) -> None:
        if hasattr(self, "engine") and hasattr(self.engine, "destroy"):
            self.engine.destroy()
        if self._swap_ready:  # the run's own swap files go; a --nvme-path or JSON path is the user's to keep
            remove_swap(self._own_swap, self.rank)


def shm_buffer_path(rank: int) -> Path:
    """The /dev/shm file DeepSpeed's CPU all-reduce creates for ``rank`` (named as its shm.cpp names it)."""
    addr, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    return Path("/dev/shm") / f"deepspeed_allreduce_buffer_{os.getuid()}_{addr}_{port}_{rank}"


def release_shm_buffer(rank: int) -> None:
    """After DeepSpeed's comm init on every rank: wait until all have mapped every rank's /dev/shm file, then remove
    this rank's name (peers keep their mappings); nothing when there is none. A collective."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
    with contextlib.suppress(OSError):
        shm_buffer_path(rank).unlink()


def refuse_flattened(ds_config: dict[str, Any], source: str, name: str) -> None:
    """A layer-wise optimizer (LAMB) only where DeepSpeed hands it whole tensors: ZeRO stage 0 in fp32, with no
    optimizer of the JSON's own (elsewhere its trust ratio would be a flat partition's, not each tensor's)."""
    stage = ds_config.get("zero_optimization", {}).get("stage", 0)
    half = any(ds_config.get(k, {}).get("enabled") for k in ("fp16", "bf16"))
    if "optimizer" in ds_config:
        raise UserError(f"--optim lamb with {source}: its \"optimizer\" section would replace scale-ocr's {name}; "
                        "remove that section to train with LAMB")
    if stage or half:
        what = f"ZeRO stage {stage}" if stage else "its 16-bit optimizer"
        raise UserError(f"--optim lamb under {source} ({what}): DeepSpeed flattens tensors into partitions, and "
                        f"LAMB's per-tensor trust ratio would become one per partition; use --strategy fsdp, ddp or "
                        f"fairscale (whole or per-tensor shards), or a DeepSpeed JSON with stage 0 in fp32")
