"""The memory model: what each strategy holds per rank, in theory and as its engine really does (docs/memory.md).

Three figures in bytes per rank: the ZeRO paper's **ideal**, the **engine**'s own (from the strategy's
:class:`StateLayout`, its departures from the ideal), and **deepspeed**'s estimators, reproduced without importing it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

FP32 = 4


@dataclass(frozen=True)
class StateLayout:
    """How one engine stores model state, per parameter element.

    Attributes:
        ideal_stage: the ZeRO stage (0-3) whose ideal formula this strategy is compared with.
        mixed: weights are held in 16 bits with an fp32 master (DeepSpeed bf16/fp16), not fp32 under autocast.
        param_bytes, params_sharded: stored weights.
        grad_bytes, grads_sharded: gradients kept until the step.
        step_grad_bytes: an extra fp32 gradient the engine builds for the step (DeepSpeed upcasts its
            gradient partition), over ``step_grad_chunk`` elements at a time (None: the whole shard).
        master_bytes: fp32 master weights kept beside the stored weights (0 when they are the master).
        optim_bytes, optim_sharded: Adam's moments.
        buffer_bytes: engine buffers allocated up front whatever the model size (ZeRO-3's reduce bucket).
        host: the parts in host memory on an accelerator, "optimizer", "grads", "params" joined by "+" ("optimizer"
            takes the fp32 step gradient with it; "grads" is DeepSpeed's 16-bit partition beside it).
        disk: which parts live in swap files (NVMe offload), same names; host memory then holds only
            the part being used (one optimizer sub-group, the parameters being gathered).
        grads_staged: the fp32 gradient partition swapped out with the optimizer (``disk``) is first built whole in
            device memory (DeepSpeed's NVMe offload upcasts every partition at once), so the step's peak holds it.
        gathers_per: the time model's count of collectives: "unit" (FSDP: one all-gather and reduce-scatter per
            sharding unit), "module" (ZeRO-3: an all-gather per partitioned module), "" (buckets of about 25 MiB).
        gathers_16bit: the engine gathers fp32 weights as 16-bit copies (FSDP's mixed precision): as with ``mixed``,
            autocast saves no 16-bit copy of them.
        shard_group: the sharded parts are split over groups of this many ranks and replicated across the groups
            (HSDP); None: over all ranks.
        secondary_group: ZeRO++ hpZ keeps a second copy of the (``param_bytes``) weights, partitioned over groups
            of this many ranks (a node), which the backward gathers from instead of from every rank; 0: none.
        grads_freed: gradients are set to None after each step and rebuilt during the backward (see
            :func:`step_peak`); False where they live in buffers kept across steps (DDP's buckets, ZeRO partitions).
        note: what the engine adds beyond the ideal, in one sentence.
    """

    ideal_stage: int
    mixed: bool = False
    param_bytes: int = FP32
    params_sharded: bool = False
    grad_bytes: int = FP32
    grads_sharded: bool = False
    step_grad_bytes: int = 0
    step_grad_chunk: int | None = None
    master_bytes: int = 0
    optim_bytes: int = 2 * FP32
    optim_sharded: bool = False
    buffer_bytes: int = 0
    host: str = ""
    disk: str = ""
    gathers_16bit: bool = False
    shard_group: int | None = None
    secondary_group: int = 0
    grads_freed: bool = False
    grads_staged: bool = False
    gathers_per: str = ""
    note: str = ""

    @property
    def casts_weights(self) -> bool:
        """Whether autocast multiplies fp32 weights, saving a 16-bit copy of each for the backward (an activation
        that scales with the model, not the batch): engines that hold or gather 16-bit weights do not."""
        return not (self.mixed or self.gathers_16bit)


@dataclass(frozen=True)
class Prediction:
    """Predicted bytes per rank (``params + grads + optimizer`` is the model state; ``host`` and ``disk``
    are the parts of it kept off the device, in host memory and in swap files; ``staged`` the part of ``disk``
    that is nevertheless in device memory at the step's peak, see ``StateLayout.grads_staged``)."""

    params: float
    grads: float
    optimizer: float
    other: float
    host: float
    ideal: float
    disk: float = 0.0
    staged: float = 0.0

    @property
    def model_state(self) -> float:
        return self.params + self.grads + self.optimizer

    @property
    def resident(self) -> float:
        """Model state and engine buffers in device memory at the step's peak (never negative: every part
        subtracted as offloaded is a part of the model state)."""
        return self.model_state + self.other - self.host - self.disk + self.staged

    def as_dict(self) -> dict[str, float]:
        return {**asdict(self), "model_state": self.model_state}


def step_peak(state: float, grads: float, activations: float, grads_freed: bool) -> float:
    """A training step's peak bytes from its model state (gradients included) and its activations.

    Where gradients are freed after each step (``StateLayout.grads_freed``), the forward runs without them and
    the backward builds them while it frees the activations: for a stack of similar layers the two sum to
    ``A + (G - A) f`` a fraction ``f`` into the backward, whose largest value is the larger of them, not their
    sum."""
    return state + activations - (min(grads, activations) if grads_freed else 0.0)


#: Copies of one tensor a save holds at once, in fp32: the gathered whole (an all-gather's output) and the copy
#: handed to the writer on rank 0 (checkpoint/model_files.py; a checkpoint writes a box of one rank's part, less).
SAVE_COPIES = 2


def save_peak(state: float, grads: float, largest_tensor: int, grads_freed: bool) -> float:
    """A save's peak bytes on a rank: what training holds between steps (the model state, without the gradients an
    engine frees after each step) plus the one tensor in flight. Every save (the whole-model files, a checkpoint,
    an export) goes a tensor at a time, so the model's size never adds to it, only its largest tensor's
    (``largest_tensor`` elements; a layer's parameters bound it)."""
    return state - (grads if grads_freed else 0.0) + SAVE_COPIES * FP32 * largest_tensor


def ideal_model_state(n: int, world: int, stage: int, mixed: bool) -> float:
    """The ZeRO paper's model-state bytes per rank (Rajbhandari et al. 2020, section 5)."""
    p, g, k = (2, 2, 12) if mixed else (4, 4, 8)
    return n * (p / (world if stage >= 3 else 1) + g / (world if stage >= 2 else 1) + k / (world if stage >= 1 else 1))


def predict(layout: StateLayout, n: int, world: int) -> Prediction:
    """Bytes per rank that ``layout``'s engine holds at the optimizer step for ``n`` parameters."""
    group = layout.shard_group or world  # the ranks a sharded part is split over
    shard = n / group

    def per(bytes_: int, sharded: bool) -> float:
        return bytes_ * (shard if sharded else n)

    params = per(layout.param_bytes, layout.params_sharded)
    if layout.secondary_group:
        params += layout.param_bytes * n / layout.secondary_group
    step_elems = shard if layout.step_grad_chunk is None else min(layout.step_grad_chunk, shard)
    grads16 = per(layout.grad_bytes, layout.grads_sharded)
    step_grad = layout.step_grad_bytes * step_elems  # the fp32 gradient the optimizer steps on, as held
    optimizer = per(layout.master_bytes + layout.optim_bytes, layout.optim_sharded)
    parts = {"optimizer": optimizer + step_grad, "grads": grads16, "params": params}
    host = sum(v for k, v in parts.items() if k in layout.host.split("+"))
    disk = sum(v for k, v in parts.items() if k in layout.disk.split("+"))
    staged = step_grad if layout.grads_staged and "optimizer" in layout.disk.split("+") else 0.0
    return Prediction(params, grads16 + step_grad, optimizer, float(layout.buffer_bytes), host,
                      ideal_model_state(n, group, layout.ideal_stage, layout.mixed), disk, staged)


def deepspeed_estimate(stage: int, n: int, largest_layer: int, world: int, offload_optimizer: bool,
                       offload_params: bool, gpus_per_node: int | None = None,
                       additional_buffer_factor: float = 1.5) -> tuple[int, int]:
    """(host, device) bytes from DeepSpeed's model-state estimators for mixed-precision ZeRO-2/3,
    with the same arguments and arithmetic (``zero_init=True`` for stage 3, DeepSpeed's default)."""
    gpus_per_node = gpus_per_node or world
    nodes = world // gpus_per_node
    if stage <= 2:
        if offload_optimizer:
            device = 2 * n
            host = n * max(4 * world, 16) * additional_buffer_factor
        else:
            device = 2 * n + int(18 * n / world)
            host = n * 4 * gpus_per_node * additional_buffer_factor
        return int(host), int(device)
    largest = 4 * largest_layer
    if offload_optimizer and offload_params:
        device, host = largest, n * 18 * (1 / nodes) * additional_buffer_factor
    elif offload_optimizer:
        device, host = largest + int(2 * n / world), n * 16 * (1 / nodes) * additional_buffer_factor
    else:
        device, host = largest + int(18 * n / world), largest_layer * 4 * gpus_per_node * additional_buffer_factor
    return int(host), int(device)
