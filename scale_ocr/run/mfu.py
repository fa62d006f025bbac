"""Model FLOPs utilisation: the FLOP/s a run's model work amounts to, over what its devices can do.

``MFU = counted FLOPs per training sample x samples/s / (peak FLOP/s of one device x devices)``. The peak comes from
:data:`GPU_PEAKS` (datasheet dense figures; fp32 counts against TF32 where torch allows it) or, for CPUs and GPUs not
in the table, from square ``torch.mm`` products measured on one thread by that thread's CPU time (so other jobs on
a shared host do not lower it), times the run's threads, cached in ``$XDG_CACHE_HOME/scale_ocr/peak_flops.json``.
The count is cached beside it (``flop_counts.json``), keyed by the model and the code that counted it: counting
runs the model's forward and backward under torch's FLOP counter, a few seconds of every start on a small CPU.
Each rank counts as one device. Inputs read at their own width (``--max-width``) are billed batch by batch at the
width each was padded to (:class:`WidthCost`). How to read it: docs/mfu.md.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from scale_ocr.disk import read_user_json
from scale_ocr.distributed.process_group import DistInfo, all_reduce_sum
from scale_ocr.errors import UserError, say
from scale_ocr.run.flops import FlopCount, flops_per_sample

# Dense peak FLOP/s per device, (fp32, tf32, bf16/fp16), from each vendor's datasheet; sparsity figures halved.
# Matched by substring of torch.cuda.get_device_name(), first match wins (so "H100 PCIe" before "H100").
GPU_PEAKS: tuple[tuple[str, str, tuple[float, float | None, float | None]], ...] = (
    # https://www.nvidia.com/en-us/data-center/h200/ (H200 SXM; NVL: 60 / 417 / 835)
    ("H200 NVL", "H200 NVL", (60e12, 417e12, 835e12)),
    ("H200", "H200 SXM", (67e12, 494.5e12, 989.5e12)),
    # https://www.nvidia.com/en-us/data-center/h100/ (datasheet: SXM 67 / 989 sparse / 1,979 sparse)
    ("H100 PCIe", "H100 PCIe", (51e12, 378e12, 756e12)),
    ("H100 NVL", "H100 NVL", (60e12, 417e12, 835e12)),
    ("H100", "H100 SXM", (67e12, 494.5e12, 989.5e12)),
    # https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf
    ("A100", "A100", (19.5e12, 156e12, 312e12)),
    # https://www.nvidia.com/en-us/data-center/l40s/
    ("L40S", "L40S", (91.6e12, 183e12, 362e12)),
    # https://www.nvidia.com/en-us/data-center/l4/
    ("L4", "L4", (30.3e12, 60e12, 121e12)),
    # https://www.nvidia.com/en-us/data-center/products/a10-gpu/ (A10G, AWS's variant, is measured instead)
    ("A10G", "", (0.0, None, None)),
    ("A10", "A10", (31.2e12, 62.5e12, 125e12)),
    # https://images.nvidia.com/content/technologies/volta/pdf/volta-v100-datasheet-update-us-1165301-r5.pdf
    # (SXM2; fp16 tensor cores, no bf16 or tf32)
    ("V100", "V100 SXM2", (15.7e12, None, 125e12)),
    # https://www.amd.com/en/products/accelerators/instinct/mi300/mi300x.html (matrix fp32 163.4)
    ("MI300X", "MI300X", (163.4e12, 653.7e12, 1307.4e12)),
    # https://www.amd.com/en/products/accelerators/instinct/mi200/mi250x.html
    ("MI250X", "MI250X", (95.7e12, None, 383e12)),
)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
CACHE_NAME = "peak_flops.json"
COUNTS_NAME = "flop_counts.json"
COUNTS_KEPT = 64  # counts the cache holds (the newest): one per model, size and version a user trains


def cache_path(name: str) -> Path:
    """A cache file of scale_ocr's: ``$XDG_CACHE_HOME/scale_ocr/NAME`` (default ``~/.cache/scale_ocr/NAME``)."""
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "scale_ocr" / name


def read_cache(path: Path, what: str = "the peak-FLOPs cache") -> dict[str, Any]:
    """A JSON cache; an unreadable or damaged file is an empty cache (measured again), never an error."""
    try:
        data = read_user_json(path, what=what)
    except (OSError, UserError):
        return {}
    return data if isinstance(data, dict) else {}


def write_cache(path: Path, data: dict[str, Any]) -> None:
    """Atomically (temp file, rename); a cache that cannot be written is only measured again next time."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(data, indent=1), encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)


@dataclass(frozen=True)
class Peak:
    """One device's peak FLOP/s for a precision, and where the figure comes from (MFU's denominator)."""

    flops: float
    source: str


def gpu_peak(name: str, precision: str, tf32: bool) -> Peak | None:
    """The table's peak of the GPU called ``name`` at ``precision`` (fp32 counts as TF32 when ``tf32``); None when
    the table does not know it (or its figure for that precision)."""
    for match, label, (fp32, tf32_peak, half) in GPU_PEAKS:
        if match in name:
            kind, flops = ("bf16/fp16", half) if precision != "fp32" else \
                ("tf32", tf32_peak) if tf32 and tf32_peak else ("fp32", fp32)
            return Peak(flops, f"table: {label} {kind} dense") if flops else None
    return None


def measure_mm_peak(device: torch.device, dtype: torch.dtype, seconds: float = 0.4) -> float:
    """The best FLOP/s of square ``torch.mm`` products on ``device`` at ``dtype`` over about ``seconds``: on a CPU,
    of one core (one thread, timed by that thread's CPU time, so other jobs sharing the host do not lower it)."""
    n = 1024 if device.type == "cpu" else 8192
    a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
    threads = torch.get_num_threads()
    cpu = device.type == "cpu"
    clock = time.thread_time if cpu else time.perf_counter
    if cpu:
        torch.set_num_threads(1)  # the product then runs in this thread, whose CPU time is the cost
    try:
        torch.mm(a, b)  # first call: kernel selection, page faults
        best, end = 0.0, time.perf_counter() + seconds
        while time.perf_counter() < end or best == 0.0:
            if not cpu:
                torch.cuda.synchronize(device)
            t0 = clock()
            for _ in range(4):
                torch.mm(a, b)
            if not cpu:
                torch.cuda.synchronize(device)
            best = max(best, 4 * 2 * n**3 / max(clock() - t0, 1e-9))
    finally:
        torch.set_num_threads(threads)
    return best


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def measured_peak(device: torch.device, precision: str) -> Peak:
    """The measured matrix-multiply peak of ``device`` at ``precision`` (a CPU: one core's, cached, times this
    process's threads)."""
    from scale_ocr.precision import emulates_gemm

    dtype = torch.float32 if emulates_gemm(precision, device) else DTYPES[precision]
    dtype_name = str(dtype).removeprefix("torch.")
    threads = torch.get_num_threads() if device.type == "cpu" else 1
    if device.type == "cpu":
        isa = torch.backends.cpu.get_cpu_capability()
        where, what = f"{_cpu_model()}|{isa}", f"{isa}, {threads} x 1 thread"
    else:
        where = what = torch.cuda.get_device_name(device)
    key = f"{where}|{dtype_name}|torch {torch.__version__}"
    path = cache_path(CACHE_NAME)
    cache = read_cache(path)
    flops = cache.get(key)
    if isinstance(flops, bool) or not isinstance(flops, (int, float)) or not 0 < flops < float("inf"):
        flops = measure_mm_peak(device, dtype)
        write_cache(path, {**cache, key: flops})
    return Peak(float(flops) * threads, f"measured mm peak, {what}, {dtype_name}")


def device_peak(device: torch.device, precision: str) -> Peak:
    """MFU's denominator for one device of this run: the GPU table where it knows the part, else measured."""
    if device.type == "cuda":
        tf32 = torch.backends.cuda.matmul.allow_tf32 or torch.backends.cudnn.allow_tf32
        peak = gpu_peak(torch.cuda.get_device_name(device), precision, tf32)
        if peak is not None:
            return peak
    return measured_peak(device, precision)


@dataclass(frozen=True)
class WidthCost:
    """Training FLOPs per sample against the width of inputs read at their own width: counted at three widths (the
    narrowest, the widest and one between) and passed through them by a quadratic, which is exact for these models:
    a convolution's or a recurrent layer's work is affine in the width, a ViT's is affine in its tokens plus its
    attention's, quadratic in them, and its tokens are affine in the width."""

    widths: tuple[int, ...]
    totals: tuple[int, ...]  # forward + backward FLOPs per sample at each of ``widths``

    def __call__(self, width: int) -> float:
        xs, ys = self.widths, self.totals
        return float(sum(y * _lagrange(xs, i, width) for i, y in enumerate(ys)))


def _lagrange(xs: tuple[int, ...], i: int, x: float) -> float:
    out = 1.0
    for j, xj in enumerate(xs):
        if j != i:
            out *= (x - xj) / (xs[i] - xj)
    return out


def count_widths(height: int, widest: int) -> tuple[int, ...]:
    """The widths :class:`WidthCost` counts at: the height (the narrowest input), the widest, and a multiple of the
    height near halfway (a valid input width for every model: a CRNN's stride and a ViTSTR's patch divide it)."""
    middle = height * max(1, round((height + widest) / 2 / height))
    return tuple(sorted({height, min(middle, widest), widest}))


class Utilization:
    """A run's MFU: its counted FLOPs against ``devices`` x one device's peak.

    Args:
        flops: the model's training FLOPs per sample (at the task's input size: for inputs read at their own width,
            the widest).
        peak: one device's peak FLOP/s and its source.
        devices: devices the job trains on (its ranks).
        cost: inputs read at their own width: FLOPs per sample by width, so each batch is billed at its own.
    """

    def __init__(self, flops: FlopCount, peak: Peak, devices: int, cost: WidthCost | None = None) -> None:
        self.flops, self.peak, self.devices, self.cost = flops, peak, devices, cost

    @classmethod
    def for_run(cls, task, precision: str, dist: DistInfo) -> Utilization:
        """Count the run's model and measure the peak on rank 0 alone; the other ranks wait in the all-reduce that
        hands them the figures (so they neither repeat the count nor share the cores with the measurement)."""
        widths = count_widths(*task.input_size) if getattr(task, "own_width", False) else ()
        counts: list[FlopCount] = []
        for width in widths if dist.is_main else ():  # the widest last: the count metrics.json states
            counts.append(_count(task, precision, width))
            if not counts[-1].total:  # not countable: said once
                break
        flops = (counts[-1] if counts else _count(task, precision)) if dist.is_main else FlopCount(0, 0, "")
        peak = device_peak(dist.device, precision) if dist.is_main else Peak(0.0, "")
        totals = [c.total for c in counts] + [0] * (len(widths) - len(counts))
        forward, backward, value, *totals = all_reduce_sum([flops.forward, flops.backward, peak.flops, *totals],
                                                           dist.device)
        how, source = (flops.how, peak.source) if dist.is_main else ("rank 0's", "rank 0's")
        cost = WidthCost(widths, tuple(int(t) for t in totals)) if widths and all(t > 0 for t in totals) else None
        return cls(FlopCount(int(forward), int(backward), how), Peak(value, source), dist.world_size, cost)

    @property
    def peak_total(self) -> float:
        """Peak FLOP/s of the whole job."""
        return self.peak.flops * self.devices

    def billed(self, samples: int, width: int | None) -> float:
        """Training FLOPs of a micro-batch of ``samples`` inputs padded to ``width`` (None: the task's input size)."""
        if not self.flops.total:
            return 0.0
        return samples * (self.cost(width) if self.cost is not None and width is not None else self.flops.total)

    def mfu(self, flops_per_sec: float) -> float | None:
        """Model FLOP/s (the billed FLOPs over the seconds they took) over the job's peak (None without a rate or a
        count)."""
        if not flops_per_sec > 0 or not self.peak_total > 0 or not self.flops.total > 0:
            return None
        return flops_per_sec / self.peak_total

    def metrics(self, flops_per_sec: float) -> dict[str, float | None]:
        """The per-log-line fields (metrics.jsonl, W&B): MFU and the FLOP/s on both sides of it."""
        achieved = flops_per_sec if flops_per_sec > 0 and self.flops.total > 0 else None
        return {"train/mfu": self.mfu(flops_per_sec), "train/model_flops_per_sec": achieved,
                "train/peak_flops_per_sec": self.peak_total}

    def describe(self, flops_per_sec: float) -> str:
        """``mfu=3.1% of 2x310 GFLOP/s``: the log line's part (the source is in metrics.json and the first line)."""
        mfu = self.mfu(flops_per_sec)
        return f"mfu={mfu:.2%} of {self.devices}x{_flops_text(self.peak.flops)}" if mfu is not None else "mfu=n/a"

    def summary(self, flops_per_sec: float) -> dict[str, Any]:
        """metrics.json's fields: MFU over the timed steps, the FLOPs per sample and the peak with its source."""
        by_width = {"by_width": dict(zip(map(str, self.cost.widths), self.cost.totals, strict=True))} \
            if self.cost is not None else {}
        return {"mfu": self.mfu(flops_per_sec),
                "flops_per_sample": {"forward": self.flops.forward, "backward": self.flops.backward,
                                     "total": self.flops.total, "counted": self.flops.how, **by_width},
                "peak_flops": {"per_device": self.peak.flops, "devices": self.devices, "source": self.peak.source}}

    def line(self) -> str:
        """The run's first line about it: what MFU is computed from."""
        counted = (f"{_flops_text(self.flops.total, 'FLOP')} per training sample "
                   f"({_flops_text(self.flops.forward, 'FLOP')} forward, counted)" if self.flops.total else
                   "FLOPs not counted")
        if self.cost is not None and self.flops.total:
            w = self.cost.widths
            counted = (f"{_flops_text(self.cost.totals[0], 'FLOP')} to {_flops_text(self.cost.totals[-1], 'FLOP')} "
                       f"per training sample {w[0]} to {w[-1]} px wide (counted at {', '.join(map(str, w))} px); each "
                       "micro-batch billed at the width it is padded to")
        return (f"scale-ocr: MFU against {self.devices} x {_flops_text(self.peak.flops)} ({self.peak.source}); "
                f"{counted}")


@functools.cache
def _code_version() -> str:
    """A digest of scale_ocr's own source and of the libraries its models are built from: a count is reused only by
    the code that made it (a changed forward counts again)."""
    from importlib import metadata

    digest = hashlib.sha256()
    for name in ("torch", "torchvision", "python-doctr"):
        try:
            digest.update(f"{name}={metadata.version(name)};".encode())
        except metadata.PackageNotFoundError:
            pass
    root = Path(__file__).resolve().parents[1]
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def _count_key(task, precision: str, width: int | None = None) -> str | None:
    """What the count of ``task``'s model (at inputs ``width`` wide) depends on, as one digest; None for a task that
    cannot say."""
    try:
        facts = [type(task).__qualname__, task.identity(), repr(task.model_kwargs()),
                 repr(task.cfg.size_overrides()), precision, _code_version(), *([width] if width else [])]
    except (AttributeError, OSError, TypeError):
        return None
    return hashlib.sha256(json.dumps(facts, sort_keys=True, default=repr).encode()).hexdigest()


def _cached_count(path: Path, key: str) -> FlopCount | None:
    entry = read_cache(path, "the FLOP-count cache").get(key)
    if not isinstance(entry, dict):
        return None
    forward, backward, how = entry.get("forward"), entry.get("backward"), entry.get("how")
    numbers = all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (forward, backward))
    return FlopCount(forward, backward, how) if numbers and forward and how in ("meta", "cpu") else None


def _keep_count(path: Path, key: str, count: FlopCount) -> None:
    counts = read_cache(path, "the FLOP-count cache")
    counts.pop(key, None)
    counts[key] = {"forward": count.forward, "backward": count.backward, "how": count.how, "at": time.time()}
    write_cache(path, dict(list(counts.items())[-COUNTS_KEPT:]))  # newest last


def _count(task, precision: str, width: int | None = None) -> FlopCount:
    """The run's count (``width``: at inputs that wide; from the cache when this model and code were counted before),
    or none with one warning line: a model torch cannot run to count (an operator with no meta kernel and a forward
    that fails on the CPU) trains as it would, without MFU."""
    key, path = _count_key(task, precision, width), cache_path(COUNTS_NAME)
    cached = _cached_count(path, key) if key is not None else None
    if cached is not None:
        return cached
    inputs = task.dummy_inputs if width is None else functools.partial(task.dummy_inputs, width=width)
    try:
        count = flops_per_sample(task.create_model, inputs, precision)
    except Exception as exc:  # noqa: BLE001 - counting is a measurement; it never stops the run it measures
        reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]
        say(f"scale-ocr: warning: could not count {task.arch}'s FLOPs ({reason}); the run trains without MFU "
              "(mfu null in metrics.json)", err=True)
        return FlopCount(0, 0, "not counted")
    if key is not None and count.forward > 0:
        _keep_count(path, key, count)
    return count


def _flops_text(value: float, unit: str = "FLOP/s") -> str:
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M")):
        if value >= scale:
            return f"{value / scale:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"
