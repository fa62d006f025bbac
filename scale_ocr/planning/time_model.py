"""The time model: a training step's time per strategy, before launching, from counted FLOPs and bytes moved.

Per rank at a fixed per-rank batch: compute (counted FLOPs at the device's peak x an assumed MFU), communication
(each engine's ring volumes over the link, plus 2 log2(n) hops of latency per collective) and Adam's memory-bound
step; on GPUs collectives overlap compute, on CPU hosts (gloo) nothing hides. :func:`with_host` puts a measured CPU
host in place of the datasheets (:mod:`scale_ocr.planning.host_probe`). The figures and assumptions: docs/memory.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from scale_ocr.errors import UserError
from scale_ocr.memory.model import StateLayout


@dataclass(frozen=True)
class Device:
    """One accelerator's peaks: dense FLOP/s by precision, memory bandwidth in bytes/s, where they come from, and its
    memory in bytes (None: the host's, which ``scale-ocr plan`` reads from this machine)."""

    name: str
    flops: dict[str, float]
    memory_bandwidth: float
    source: str
    memory: float | None = None

    def peak(self, precision: str) -> float:
        return self.flops[precision]


# Dense (no sparsity) peaks from the vendors' datasheets. fp32 is the plain fp32 pipeline: torch leaves TF32 off
# for matrix products unless a run asks for it, and scale-ocr's fp32 runs do not.
DEVICES: dict[str, Device] = {d.name: d for d in (
    Device("v100", {"fp32": 15.7e12, "fp16": 125e12, "bf16": 15.7e12}, 0.9e12, "NVIDIA V100 SXM2 datasheet", 32e9),
    Device("a100", {"fp32": 19.5e12, "fp16": 312e12, "bf16": 312e12}, 2.039e12, "NVIDIA A100 80GB SXM datasheet", 80e9),
    Device("h100", {"fp32": 67e12, "fp16": 989e12, "bf16": 989e12}, 3.35e12, "NVIDIA H100 SXM datasheet", 80e9),
    Device("h200", {"fp32": 67e12, "fp16": 989e12, "bf16": 989e12}, 4.8e12, "NVIDIA H200 SXM datasheet", 141e9),
    Device("l4", {"fp32": 30.3e12, "fp16": 121e12, "bf16": 121e12}, 0.3e12, "NVIDIA L4 datasheet", 24e9),
    Device("mi300x", {"fp32": 163.4e12, "fp16": 1307e12, "bf16": 1307e12}, 5.3e12, "AMD Instinct MI300X datasheet",
           192e9),
)}


@dataclass(frozen=True)
class Link:
    """A per-rank link: bandwidth in bytes/s each way, latency per hop in seconds, the share of the bandwidth
    collectives achieve on it, and ``busy``: a call's cost beyond its latency when CPU ranks compute between calls."""

    name: str
    bandwidth: float
    latency: float
    efficiency: float
    source: str
    busy: float = 0.0

    @property
    def achieved(self) -> float:
        return self.bandwidth * self.efficiency


LINKS: dict[str, Link] = {k.name: k for k in (
    Link("nvlink3", 300e9, 5e-6, 0.8, "A100 NVLink 3: 600 GB/s both ways per GPU"),
    Link("nvlink4", 450e9, 5e-6, 0.8, "H100 NVLink 4: 900 GB/s both ways per GPU"),
    Link("pcie4", 32e9, 10e-6, 0.75, "PCIe 4.0 x16: 32 GB/s each way"),
    Link("pcie5", 64e9, 10e-6, 0.75, "PCIe 5.0 x16: 64 GB/s each way"),
    Link("ib200", 25e9, 10e-6, 0.85, "InfiniBand HDR 200 Gb/s, one NIC per GPU"),
    Link("ib400", 50e9, 10e-6, 0.85, "InfiniBand NDR 400 Gb/s, one NIC per GPU"),
    Link("eth100", 12.5e9, 30e-6, 0.7, "100 GbE with RoCE, one NIC per GPU"),
    Link("eth25", 3.125e9, 50e-6, 0.7, "25 GbE, TCP"),
    Link("eth10", 1.25e9, 50e-6, 0.7, "10 GbE, TCP"),
)}


def link(name: str) -> Link:
    if name not in LINKS:
        raise UserError(f"unknown link {name!r}; pick one of {', '.join(LINKS)} (or measure this host's: --link host)")
    return LINKS[name]


def device(name: str) -> Device:
    if name not in DEVICES:
        raise UserError(f"unknown device {name!r}; pick one of {', '.join(DEVICES)} (or this host's CPU: --device "
                        "host)")
    return DEVICES[name]


@dataclass(frozen=True)
class Cluster:
    """Where the ranks run: the device, the links within and between nodes, ranks per node, and the overlap rule
    (``overlap``: collectives run beside compute on their own stream, as on GPUs; False on CPU hosts)."""

    device: Device
    intra: Link
    inter: Link
    per_node: int
    overlap: bool = True
    coalesces: bool = True  # NCCL launches a list of small collectives as one; gloo runs them one by one

    def link_for(self, ranks: int) -> Link:
        """The slowest link a collective over ``ranks`` consecutive ranks crosses."""
        return self.intra if ranks <= self.per_node else self.inter

    def describe(self) -> str:
        return (f"{self.device.name} ({self.device.source}), {self.per_node} per node over {self.intra.name}, "
                f"nodes over {self.inter.name}; communication {'overlaps' if self.overlap else 'does not overlap'} "
                "compute")


@dataclass(frozen=True)
class Workload:
    """One rank's work per optimizer step. ``units`` (FSDP's) and ``modules`` (ZeRO-3's all-gathers a step) set how
    many collectives those engines issue (0: estimated from the sizes); ``persistent`` weights (``persistent_numel``
    elements in all) are too small for ZeRO-3 to partition: DeepSpeed all-gathers each after every step."""

    flops_forward: float
    flops_backward: float
    batch: int
    params: int
    largest_layer: int
    precision: str
    checkpointing: bool = False
    units: int = 0
    modules: int = 0
    persistent: int = 0
    persistent_numel: int = 0

    def count(self, per: str, passes: int = 1) -> int:
        """Collectives of one kind per step: one per sharding unit and pass, or ZeRO-3's gathers (``modules``)."""
        guess = max(1, round(self.params / max(self.largest_layer, 1)))
        if per == "unit":
            return passes * max(1, self.units or guess)
        return max(1, self.modules or passes * guess)


BUCKET = 25 * 2**20  # bytes per bucketed collective: DDP's bucket_cap_mb; DeepSpeed's presets' buckets are near it


@dataclass(frozen=True)
class StepTime:
    """Predicted seconds of one step, by part (``comm`` is all collective time, ``exposed`` the part of it
    compute does not hide), and the bytes each rank sends."""

    compute: float
    comm: float
    exposed: float
    optimizer: float
    comm_bytes: float
    extra: dict[str, Any] = field(default_factory=dict)
    other: float = 0.0

    @property
    def total(self) -> float:
        return self.compute + self.exposed + self.optimizer + self.other

    def as_dict(self) -> dict[str, Any]:
        return {"compute_s": self.compute, "comm_s": self.comm, "exposed_comm_s": self.exposed,
                "optimizer_s": self.optimizer, "other_s": self.other, "step_s": self.total,
                "comm_bytes": self.comm_bytes, **self.extra}


@dataclass(frozen=True)
class EngineCost:
    """One engine's own step on one rank of this host, from a short training run: its forward and backward with the
    engine's hooks, casts and copies (on small models this, not the FLOPs, sets the step), its optimizer, the rest."""

    compute: float
    optimizer: float
    other: float
    threads: int
    scale: float = 1.0  # how much slower the model computes with a job's ranks sharing the host (probed)


#: ZeRO-3's gathers of its persistent weights after each step (see :func:`comm_volumes`).
SMALL_PARAMS = "all-gather small params after the step"
#: Phases whose calls follow one another with no compute between them (one launch where the backend coalesces).
BACK_TO_BACK = frozenset({SMALL_PARAMS})


def _collective(volume: float, ranks: int, lnk: Link, calls: int = 1, busy: bool = True) -> float:
    """Seconds to move ``volume`` bytes per rank in ``calls`` collectives over ``ranks`` ranks (``busy``: between
    slices of compute)."""
    if ranks <= 1 or volume <= 0:
        return 0.0
    return volume / lnk.achieved + calls * (2 * math.log2(ranks) * lnk.latency + (lnk.busy if busy else 0.0))


def comm_volumes(layout: StateLayout, n: int, world: int,
                 work: Workload | None = None) -> list[tuple[str, float, int, int]]:
    """Per-rank bytes of each collective phase of one step: ``(phase, bytes, ranks it spans, calls)``."""
    group = min(layout.shard_group or world, world)
    if world <= 1:
        return []

    def calls(volume: float, per: str = "", passes: int = 1) -> int:
        if per and work is not None:
            return work.count(per, passes)
        return max(1, math.ceil(volume / BUCKET))

    if layout.ideal_stage == 0:  # DDP: the gradients, all-reduced
        volume = 2 * (world - 1) / world * layout.grad_bytes * n
        return [("all-reduce grads", volume, world, calls(volume))]
    grad_comm = layout.grad_bytes or layout.param_bytes  # offloaded ZeRO-1/2 keeps no 16-bit grads but sends them
    gather = 2 if layout.gathers_16bit else layout.param_bytes
    gathers = 2 if layout.ideal_stage == 3 and layout.params_sharded else 1
    f = (group - 1) / group
    scatter, gathered = f * grad_comm * n, f * gathers * gather * n
    phases = [("reduce-scatter grads", scatter, group, calls(scatter, "unit" if layout.gathers_per == "unit" else "")),
              (f"all-gather params x{gathers}", gathered, group, calls(gathered, layout.gathers_per, gathers))]
    if layout.gathers_per == "module" and work is not None and work.persistent:
        # DeepSpeed ZeRO-3 after each step: every weight under its persistence threshold, gathered one by one.
        phases.append((SMALL_PARAMS, f * gather * work.persistent_numel, group, work.persistent))
    if group < world:  # HSDP: the shard's gradients all-reduced across the replica groups
        replicas = world // group
        volume = 2 * (replicas - 1) / replicas * 4 * n / group
        phases.append(("all-reduce grads across "
                       "groups", volume, world, calls(volume, "unit" if layout.gathers_per else "")))
    return phases


def optimizer_bytes(layout: StateLayout, n: int, world: int) -> float:
    """Bytes Adam's step reads and writes on one rank: about 28 per parameter it updates (parameter, gradient, two
    moments), 34 with DeepSpeed's 16-bit copy and upcast gradient."""
    group = min(layout.shard_group or world, world)
    updated = n / group if layout.optim_sharded else n
    return updated * (34 if layout.mixed else 28)


def predict_step(layout: StateLayout, work: Workload, world: int, cluster: Cluster, mfu: float,
                 engine: EngineCost | None = None) -> StepTime:
    """One step's predicted time on one rank of ``world`` under ``layout``'s engine; with ``engine`` (measured on
    one rank here) its compute, optimizer and remainder come from that run instead of FLOPs and bytes."""
    rate = cluster.device.peak(work.precision) * mfu
    fwd = work.flops_forward * work.batch / rate
    bwd = (work.flops_backward + (work.flops_forward if work.checkpointing else 0)) * work.batch / rate
    if engine is not None:  # the engine's own forward and backward, split as the FLOPs split
        measured = engine.compute * engine.scale
        fwd, bwd = fwd / (fwd + bwd) * measured, bwd / (fwd + bwd) * measured
    phases = [(name, volume, ranks, 1 if cluster.coalesces and name in BACK_TO_BACK else calls)
              for name, volume, ranks, calls in comm_volumes(layout, work.params, world, work)]
    comm = sum(_collective(volume, ranks, cluster.link_for(ranks), calls, name not in BACK_TO_BACK)
               for name, volume, ranks, calls in phases)
    volume = sum(v for _, v, _, _ in phases)
    exposed = comm
    if cluster.overlap and phases:
        unit = 2 * work.largest_layer * (layout.grad_bytes or layout.param_bytes)  # one unit's gather + reduce
        tail = _collective(unit, world, cluster.link_for(world))
        if layout.ideal_stage == 0:
            exposed = max(comm - bwd, 0.0) + min(tail, comm)
        elif layout.ideal_stage == 3 and layout.params_sharded:
            exposed = max(comm - fwd - bwd, 0.0) + min(tail, comm)
        else:  # ZeRO-1/2, fairscale, FSDP without resharding: the post-step all-gather is not hidden
            _, gather, ranks, calls = next(p for p in phases if p[0].startswith("all-gather"))
            t_gather = _collective(gather, ranks, cluster.link_for(ranks), calls)
            exposed = max(comm - t_gather - bwd, 0.0) + t_gather + min(tail, comm)
    opt = optimizer_bytes(layout, work.params, world) / cluster.device.memory_bandwidth
    if engine is not None:  # memory-bound: the measured step, for the share of the parameters this rank updates
        opt = engine.optimizer * optimizer_bytes(layout, work.params, world) / optimizer_bytes(layout, work.params, 1)
    return StepTime(fwd + bwd, comm, exposed, opt, volume,
                    {"phases": {name: {"bytes": v, "calls": c} for name, v, _, c in phases},
                     "link": cluster.link_for(world).name}, engine.other if engine else 0.0)


def with_host(cluster: Cluster, flops: float, memory_bandwidth: float, bandwidth: float, latency: float,
              busy: float | None = None) -> Cluster:
    """``cluster`` on a measured host: its achieved FLOP/s (``mfu`` 1 then applies), memory bandwidth and gloo link
    (bandwidth, seconds per call, and per call between slices of compute), and no overlap."""
    host = Device("host", {p: flops for p in ("fp32", "bf16", "fp16")}, memory_bandwidth, "measured on this host")
    # A call over 2 ranks pays 2 log2(2) = 2 hops in _collective: the measured per-call latency is split over them.
    measured = Link("host", bandwidth, latency / 2, 1.0, "gloo between two local processes, measured",
                    max(0.0, (busy or latency) - latency))
    return replace(cluster, device=host, intra=measured, inter=measured, overlap=False, coalesces=False)
