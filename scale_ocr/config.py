"""The run configuration: frozen, typed sections that flow from the CLI to each component.

Every field carries its help text and flag spellings in ``metadata``, so :mod:`scale_ocr.cli.args`
builds the command line from these classes and nothing is declared twice. Precedence is
defaults -> ``--config FILE`` (JSON or YAML) -> command-line flags.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from scale_ocr.errors import UserError, path_problem, shown

PRECISIONS = ("fp32", "bf16", "fp16")
OPTIMIZERS = ("adamw", "adam", "lamb")
LR_SCALINGS = ("none", "linear", "sqrt")  # scale_ocr.optim.scale_factor says what each does
LR_ON_RESUME = ("keep", "rescale")
SCHEDULES = ("cosine", "onecycle", "constant")
BAD_SAMPLE_POLICIES = ("error", "skip")
WORD_STYLES = ("line", "page", "text")  # scale_ocr.data.synthetic.WORD_STYLES, named here so --help needs no Pillow
COMPILE_BACKENDS = ("inductor", "aot_eager")  # torch.compile backends --compile accepts
FRAME_WIDTH = 4  # input columns per CTC frame in every registered recognizer: CRNN strides W/4, ViTSTR patches 4 wide
# Model-size overrides: config field -> the registry builder's keyword. A model takes those its builder accepts.
MODEL_SIZE_FIELDS = {"model_width": "width", "model_depth": "depth", "model_heads": "heads", "mlp_ratio": "mlp_ratio"}
MODEL_IDENTITY_FIELDS = (*MODEL_SIZE_FIELDS, "max_width")  # recorded with a model when given; absent: the default


def opt(default: Any, help: str, *flags: str, aliases: tuple[str, ...] = (), **argparse_kw: Any) -> Any:
    """A config field whose metadata describes its command-line flag: ``help`` is --help's line, ``flags`` its
    spellings (default ``--field-name``), ``aliases`` more accepted silently (docTR's underscore flags), and
    ``argparse_kw`` goes to ``add_argument`` (``choices``, ``type``, ``nargs``, ``metavar``). ``default`` is
    immutable (tuples, not lists)."""
    meta = {"help": help, "flags": flags, "aliases": aliases, "argparse": argparse_kw}
    return field(default=default, metadata=meta)


def _require_finite(section: Any, *names: str) -> None:
    """Refuse NaN and infinity, which float() accepts from the command line and YAML (``.nan``) alike."""
    defaults = {f.name: f.default for f in dataclasses.fields(section)}
    for name in names:
        value = getattr(section, name)
        if value is not None and not math.isfinite(value):
            keep = f" for the default {defaults[name]}" if defaults[name] is not None else ""
            raise UserError(f"--{name.replace('_', '-')} {value} is not a finite number; "
                            f"give an ordinary number or leave it out{keep}")


PAGE_SCALES = ("native", "fit")  # or a positive factor; scale_ocr.data.det_transforms reads them
PAGE_SCALE_RANGE = (0.05, 8.0)  # factors outside it shrink words to nothing or blow pages past any memory
# The longest side a whole page is read at by default. A DBNet forward in eval holds about 0.5 KB of activations per
# input pixel (fp32, MobileNetV3 and ResNet-50 alike: measured as peak RSS of one forward at 512^2 and 1024^2), so a
# 2048x2048 page holds about 2 GiB, 8 of them (a validation batch of -b 8) 16 GiB: within a 24 GB GPU. 2048 reads a
# 150-dpi A4 page (1275x1650) at its own pixels and a 300-dpi one at 0.58x (30 px text stays well above DBNet's floor).
DEFAULT_MAX_PAGE_SIDE = 2048
PAGE_SIDE_LIMIT = 8192  # the largest page side a detection folder holds (scale_ocr.data.files.PAGE_LIMITS)


def canonical_page_scale(value: str | float) -> str:
    """``native``, ``fit`` or a factor as its shortest decimal (``"0.5"``); a UserError for anything else."""
    text = str(value).strip().lower()
    if text in PAGE_SCALES:
        return text
    try:
        factor = float(text)
    except ValueError:
        factor = math.nan
    low, high = PAGE_SCALE_RANGE
    if not (low <= factor <= high):  # NaN fails too
        raise UserError(f"--page-scale {shown(value, 40)}: give native (pages at their own pixels), fit (whole pages "
                        f"fitted into --input-size) or a factor between {low:g} and {high:g}, e.g. 0.5")
    return repr(factor)


def check_max_page_side(side: int | None, flag: str = "--max-page-side") -> None:
    """Refuse a page-side cap that is not a multiple of 32 (DBNet's stride) between 32 and the largest page."""
    if side is not None and (side % 32 or not 32 <= side <= PAGE_SIDE_LIMIT):
        near = min(PAGE_SIDE_LIMIT, max(32, round(side / 32) * 32))
        raise UserError(f"{flag} {side}: the longest side a page is read at must be a multiple of 32 (DBNet's "
                        f"stride) from 32 to {PAGE_SIDE_LIMIT}, e.g. {near}")


def _require_paths(section: Any, *names: str) -> None:
    """Refuse a path field (or any path of a list field) that no file system can name, before anything opens it."""
    for name in names:
        value = getattr(section, name)
        for path in value if isinstance(value, tuple) else (value,):
            if isinstance(path, str) and (problem := path_problem(path)):
                raise UserError(f"--{name.replace('_', '-')} {shown(path)} {problem}; give a path a file system "
                                "can hold")


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    arch: str = opt("crnn_mobilenet_v3_small", "model name from the registry (see `scale-ocr models`)", "arch")
    input_size: tuple[int, int] | None = opt(
        None, "input height x width, e.g. 32x128 (a single number H means Hx4H); default: the task's, 32x128 "
        "for recognition, 512x512 for detection", metavar="HxW")
    max_width: int | None = opt(None, "recognition: read crops at --input-size's height and their own width, up to PX "
                                "(a multiple of 4; wider ones squeezed); the vocabulary gains the space", metavar="PX")
    vocab: str | None = opt(None, "vocabulary: a name or the characters; names are scale_ocr's (latin, digits, "
                            "ascii_letters, english, french) and, for doctr: models, docTR's VOCABS; default: latin, "
                            "or a doctr: model's own vocabulary")
    vocab_file: str | None = opt(None, "read the vocabulary's characters from this UTF-8 text file")
    model_width: int | None = opt(None, "transformer width of a scalable model (vitstr_*); default: the model's "
                                  "(tiny 192, small 384, base 768, large 1024)", metavar="DIM")
    model_depth: int | None = opt(None, "transformer blocks of a scalable model (vitstr_*); default: the model's",
                                  metavar="N")
    model_heads: int | None = opt(None, "attention heads of a scalable model (vitstr_*); default: width / 64",
                                  metavar="N")
    mlp_ratio: float | None = opt(None, "MLP hidden width / width of a scalable model (vitstr_*); default: 4",
                                  metavar="R")
    activation_checkpointing: bool = opt(
        False, "recompute activations in the backward pass instead of keeping them (per transformer block for "
        "ViTs, per backbone stage for CNNs): less memory, about a third more compute, the same losses",
        action=argparse.BooleanOptionalAction)
    channels_last: bool = opt(
        True, "feed convolutional models (CRNNs, DBNets) their images channels-last (NHWC), which the convolution "
        "kernels run faster (measured: the compute report in benchmarks/results/README.md); equal up to rounding",
        action=argparse.BooleanOptionalAction)

    def __post_init__(self) -> None:
        # None means "the task's default", filled in by scale_ocr.run.resolve (a Task also reads it as that).
        if self.input_size is not None and min(self.input_size) < 8:
            h, w = self.input_size
            raise UserError(f"--input-size {h}x{w} is too small; use at least 8x8, e.g. 32x128")
        if self.max_width is not None and (self.max_width < 2 * FRAME_WIDTH or self.max_width % FRAME_WIDTH):
            raise UserError(f"--max-width {self.max_width} must be a multiple of {FRAME_WIDTH} of at least "
                            f"{2 * FRAME_WIDTH}, e.g. 1024")
        _require_finite(self, "mlp_ratio")
        _require_paths(self, "vocab_file", "init_from")
        if self.page_scale is not None:
            object.__setattr__(self, "page_scale", canonical_page_scale(self.page_scale))
        check_max_page_side(self.max_page_side)
        for name in MODEL_SIZE_FIELDS:  # which models take them is the registry's to say (run.resolve)
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise UserError(f"--{name.replace('_', '-')} {value} must be positive")

    def size_overrides(self) -> dict[str, Any]:
        """The model-size overrides given, as the registry builder's keywords."""
        return {kw: getattr(self, name) for name, kw in MODEL_SIZE_FIELDS.items() if getattr(self, name) is not None}

    page_scale: str | None = opt(
        None, "detection: the scale pages are trained and read at: native (their own pixels: the model trains on "
        "random crops of --input-size and reads whole pages), fit (whole pages fitted into --input-size) or a factor "
        "F (pages scaled by F, then as native); default: native with --train-path, fit for synthetic pages and "
        "doctr: models (docTR's predictor fits pages)", metavar="SCALE")
    max_page_side: int | None = opt(
        None, f"detection: the longest side a whole page is read at (validation, predict's --det-size auto); larger "
        f"pages are scaled down to it; a multiple of 32; default: {DEFAULT_MAX_PAGE_SIDE}", metavar="PX")

    init_from: str | None = opt(None, "start from the weights of this state dict file (a .pt of torch tensors, e.g. "
                                "a docTR model's, or a scale-ocr export), checked against the architecture; read "
                                "as tensors only, nothing in it runs", metavar="PATH")


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    train_path: tuple[str, ...] = opt(
        (), "docTR folder(s) (images/, labels.json), or one shard set (`scale-ocr make-shards`), or a mix at stated "
        "weights of folders, shard sets and the generator: real/=0.5 synthetic=0.3 shards/=0.2; synthetic data when "
        "omitted", aliases=("--train_path",), nargs="+", metavar="DIR")
    val_path: tuple[str, ...] = opt(
        (), "validation folder(s) in the same format, or one shard set; synthetic data when omitted",
        aliases=("--val_path",), nargs="+", metavar="DIR")
    train_samples: int | None = opt(None, "number of synthetic training samples (ignored with --train-path); default: "
                                    "the task's, 32768 words for recognition, 2048 pages for detection")
    val_samples: int | None = opt(None, "number of synthetic validation samples (ignored with --val-path); default: "
                                  "the task's, 512 words, 64 pages")
    min_chars: int = opt(3, "shortest synthetic word", aliases=("--min_chars",))
    max_chars: int = opt(8, "longest synthetic word", aliases=("--max_chars",))
    synthetic_words: str = opt(
        "line", "how synthetic words are cut: line (the font's whole line, as in word-crop datasets), page (as page "
        "OCR cuts a detector's box: page font sizes, ink, turn, noise; for page OCR) or text (words parted by spaces, "
        "--min-chars to --max-chars in all, cut as line: for --max-width)", choices=WORD_STYLES)
    fonts: tuple[str, ...] = opt(
        ("installed",), "fonts synthetic words and pages are set in: installed (every text font here), classic (the "
        "records' DejaVu faces), family names or globs, folders or file globs; faces lacking a vocabulary character "
        "are skipped and counted", nargs="+", metavar="FONT")
    workers: int | None = opt(
        None, "data-loading worker processes per rank (default: 0 on CPU, a few per GPU)", "-j", "--workers")
    on_bad_sample: str = opt(
        "error", "what to do with a bad labelled sample: stop with an error, or skip it and report the count",
        choices=BAD_SAMPLE_POLICIES)
    augment: bool | None = opt(
        None, "train-time augmentations (perspective, rotation, blur, colour jitter, noise, inversion); default: the "
        "task's: off for word recognition (they cost exact match within a 3-epoch budget: the convergence report in "
        "benchmarks/results/README.md; turn them on for many epochs over a small real set), on for detection",
        action=argparse.BooleanOptionalAction)
    degrade: tuple[str, ...] = opt((), "train-time degradations real scans show, NAME=PROBABILITY each: ink, rotate, "
                                   "perspective, blur, lowres, noise, jpeg (docs/data.md); none by default",
                                   nargs="+", metavar="NAME=P")
    data_cache: str | None = opt(None, "train and validate on a pre-rendered image cache held in memory (no "
                                 "augmentation; `scale-ocr make-cache` builds one; benchmarks use it)")
    batch_pixels: int | None = opt(None, "with --max-width: fill each training micro-batch with crops of like width "
                                   "up to PX padded pixels (crops x widest x height) instead of -b crops; every rank "
                                   "takes as many micro-batches, of near-equal pixels (docs/data.md)", metavar="PX")
    width_bucket: int | None = opt(None, "with --batch-pixels: pad each micro-batch to a multiple of PX columns, so "
                                   "that its shapes repeat (kernel caches, cuDNN's autotuning); default 4, the frame "
                                   "multiple: to its widest crop (docs/models.md)", metavar="PX")

    def __post_init__(self) -> None:
        if self.min_chars < 1 or self.max_chars < self.min_chars:
            raise UserError(
                f"--min-chars {self.min_chars} / --max-chars {self.max_chars}: need 1 <= min-chars <= max-chars"
            )
        if (self.train_samples is not None and self.train_samples < 1) or \
                (self.val_samples is not None and self.val_samples < 1):
            raise UserError("--train-samples and --val-samples must be at least 1")
        for name, low in (("workers", 0), ("batch_pixels", 1), ("width_bucket", FRAME_WIDTH)):
            if getattr(self, name) is not None and getattr(self, name) < low:
                raise UserError(f"--{name.replace('_', '-')} {getattr(self, name)}: use {low} or more")
        if (self.width_bucket or FRAME_WIDTH) % FRAME_WIDTH:
            raise UserError(f"--width-bucket {self.width_bucket}: use a multiple of {FRAME_WIDTH} (a frame's columns)")
        if self.data_cache and (self.train_path or self.val_path):
            raise UserError("--data-cache replaces --train-path/--val-path; give one or the other")
        _require_paths(self, "train_path", "val_path", "data_cache")


DEFAULT_LR = 1e-3  # AdamW's peak rate for a model whose registry entry recommends none (models.registry.ModelEntry)
# The global batch a model's recommended rate is stated at when its entry names none: docTR's recognition
# training script's batch (references/recognition/train_pytorch.py, -b 64 with Adam(W) 1e-3).
DEFAULT_REFERENCE_BATCH = 64
# The rule that carries a model's rate from its reference batch to the run's global batch: none (the rate as it is),
# as the scale-accuracy record chose it (benchmarks/results/README.md): in every model-and-set
# group with a verdict, none is the best rule at the largest batch where it keeps accuracy within a point of the
# smallest batch's, which no other rule is; docs/lr-scaling.md says what the scaled rules do above the reference.
DEFAULT_LR_SCALING = "none"


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    optim: str = opt("adamw", "optimizer; lamb: timm's LAMB (You et al. 2020: Adam with a per-tensor trust ratio, "
                     "for large batches), under every strategy that hands it whole tensors", choices=OPTIMIZERS)
    lr: float | None = opt(None, "peak learning rate at this run's global batch, used as given (default: the model's "
                           "recommended rate, which `scale-ocr models --params` lists with the batch it is stated at; "
                           "--lr-scaling linear or sqrt carries it to this run's batch)")
    wd: float = opt(1e-2, "weight decay (not applied to biases and norm layers)", aliases=("--weight-decay",))
    sched: str | None = opt(
        None, "learning-rate schedule, stepped once per optimizer step; default: the task's: onecycle for word "
        "recognition (torch's OneCycleLR shape: 30% rise from lr/25, cosine anneal; measured against cosine: "
        "the convergence report in benchmarks/results/README.md), cosine for detection", choices=SCHEDULES)
    warmup_steps: int | None = opt(None, "linear warm-up steps, used as given (default: 5% of the run for cosine, 0 "
                                   "for constant; when --lr-scaling raises the rate by a factor k > 1, k x 5% of "
                                   "the run for both, at most half of it; onecycle's 30% rise is its own warm-up)")
    clip_grad: float = opt(5.0, "clip the global gradient norm to this value; 0 disables clipping")
    lr_scaling: str | None = opt(
        None, "carry the rate from the global batch R it is stated at (the model's reference batch, `scale-ocr "
        "models --params`, or --lr-reference-batch) to this run's, G (ranks x -b x --grad-accum): linear (x G/R, "
        f"Goyal et al.), sqrt (x sqrt(G/R), the Adam rule) or none (the rate as it is, at any batch); default: "
        f"{DEFAULT_LR_SCALING}, the rule the scale-accuracy record chose (docs/lr-scaling.md)", choices=LR_SCALINGS)
    lr_reference_batch: int | None = opt(None, "the global batch --lr was tuned at, from which --lr-scaling "
                                         "linear or sqrt scales it to this run's", metavar="R")
    lr_on_resume: str = opt("keep", "a run resumed at another global batch with the same rate flags: keep the peak "
                            "rate of the run it continues, or rescale to this run's (a rate the flags changed, e.g. "
                            "another --lr, is always this run's)", choices=LR_ON_RESUME)

    @property
    def peak_lr(self) -> float:
        """``lr``; unset only in a config that :func:`scale_ocr.run.resolve.resolve` has not filled in with the
        model's rate (an engine described on its own): the general default."""
        return self.lr if self.lr is not None else DEFAULT_LR

    def __post_init__(self) -> None:
        _require_finite(self, "lr", "wd", "clip_grad")  # NaN passes every comparison below
        if self.lr is not None and self.lr <= 0:
            raise UserError(f"--lr {self.lr}: the learning rate must be positive")
        if self.clip_grad < 0:
            raise UserError(f"--clip-grad {self.clip_grad}: use 0 to disable clipping, or a positive norm")
        if self.wd < 0:  # torch's optimizers refuse it, after the process group and the model exist
            raise UserError(f"--wd {self.wd}: weight decay must be 0 (off) or positive")
        if self.lr_reference_batch is not None and self.lr_reference_batch < 1:
            raise UserError(f"--lr-reference-batch {self.lr_reference_batch}: give the global batch --lr was tuned "
                            "at, e.g. 64")


RAMP_LR_RULES = ("sqrt", "linear", "none")  # --ramp-lr: how the rate follows a batch the ramp grew
RAMP_LIMIT = 0.5  # B_simple's share --batch-ramp auto grows to: 1.5x the fewest samples (docs/scaling-pays.md)
SEED_MAX = 2**32 - 1  # numpy's and Python's usual seed range; the loader's seed * 1000 + rank stays within 64 bits


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    batch_size: int = opt(32, "micro-batch size per rank", "-b", "--batch-size", aliases=("--batch_size",))
    epochs: int = opt(5, "number of epochs (a run stops at --epochs or --max-steps, whichever comes first)")
    max_steps: int | None = opt(None, "stop after this many optimizer steps", aliases=("--max_steps",))
    grad_accum: int = opt(1, "micro-batches accumulated per optimizer step", aliases=("--grad_accum",))
    precision: str = opt("fp32", "numeric precision: bf16/fp16 autocast over fp32 weights (DeepSpeed strategies "
                         "hold 16-bit weights with fp32 master partitions)", choices=PRECISIONS)
    seed: int = opt(0, "seed for weights, data order and synthetic data")
    log_every: int = opt(10, "log training metrics every N optimizer steps")
    eval: bool = opt(True, "validate at the end of each epoch (benchmarks turn it off to time training alone)",
                     action=argparse.BooleanOptionalAction)
    eval_every: int = opt(0, "also validate every N optimizer steps within an epoch (val/* metrics at that step, as "
                          "Lightning's val_check_interval; 0: only at each epoch's end); not timed as training")
    max_bad_steps: int = opt(5, "stop after this many consecutive bad steps: a NaN/inf loss or gradient (the update is "
                             "skipped on every rank), or updated weights NaN/inf or past --max-weight-growth (no "
                             "checkpoint is written until a step is good again); the last good checkpoint is kept")
    max_weight_growth: float = opt(1000.0, "a step whose updated weights' global L2 norm exceeds this many times its "
                                   "value when training started (or resumed; floored at 1) is a bad step, as a NaN "
                                   "is: --lr 1e30 throws weights to 1e28 while loss and gradient are still finite")
    save_model: bool = opt(True, "write last_model.pt (and best_model.pt) at each epoch's end, the whole model in "
                           "fp32, gathered and written a tensor at a time on rank 0, after a checkpoint of the same "
                           "step (so a write that fails loses nothing)",
                           action=argparse.BooleanOptionalAction)
    profile_steps: int = opt(0, "profile the last N optimizer steps with torch.profiler (excluded from samples/s): "
                             "rank 0's Chrome trace in the run directory, and the communication no compute hides "
                             "(exposed_comm in metrics.json's time_breakdown; docs/time-breakdown.md)")
    noise_every: int | None = opt(None, "measure the gradient noise scale B_simple (the batch past which a larger one "
                                  "buys little; docs/scaling-pays.md) every N optimizer steps: each micro-batch's "
                                  "gradient on each rank against the step's global one; 0: off. It needs 2+ ranks "
                                  "or --grad-accum 2+ (default: every 10 steps where it has them)")
    noise_smoothing: float = opt(0.9, "weight on the past of the noise scale's moving averages, per reading (0.9: "
                                 "about the last 10 readings)")
    batch_ramp: str = opt("off", "auto: grow the global batch while it pays: the accumulation grows (at most doubling) "
                          "within --ramp-limit x the measured B_simple (docs/scaling-pays.md); the run's length is "
                          "then in samples", choices=("off", "auto"))
    ramp_limit: float = opt(RAMP_LIMIT, "--batch-ramp auto keeps the global batch at or under this many times B_simple")
    ramp_max_batch: int | None = opt(None, "--batch-ramp auto's largest global batch (default: 8x the starting one)")
    ramp_lr: str | None = opt(None, "--batch-ramp auto's rate as the batch grows, from where it started: sqrt, "
                              "linear or none (held); default: --lr-scaling's where it scales, else sqrt",
                              choices=RAMP_LR_RULES)
    gpu_memory_cap_gb: float | None = opt(None, "cap each rank's GPU memory at this many GiB, as if the device were "
                                          "that small (memory experiments: benchmarks.max_model); GPUs only")

    def __post_init__(self) -> None:
        _require_finite(self, "gpu_memory_cap_gb")  # NaN passes the check below
        if not 0 <= self.seed <= SEED_MAX:  # numpy's generators take no negative seed; torch's none past 64 bits
            raise UserError(f"--seed {self.seed}: use a whole number from 0 to {SEED_MAX} (2**32 - 1)")
        for name in ("batch_size", "grad_accum", "epochs", "log_every", "max_bad_steps"):
            if getattr(self, name) < 1:
                raise UserError(f"--{name.replace('_', '-')} {getattr(self, name)}: use at least 1")
        if self.max_steps is not None and self.max_steps < 1:
            raise UserError(f"--max-steps {self.max_steps}: use at least 1")
        if self.gpu_memory_cap_gb is not None and self.gpu_memory_cap_gb <= 0:
            raise UserError(f"--gpu-memory-cap-gb {self.gpu_memory_cap_gb:g}: give a positive number of GiB")
        if not self.max_weight_growth > 1:  # NaN too
            raise UserError(f"--max-weight-growth {self.max_weight_growth:g}: use a number above 1 (inf: no bound)")
        if self.profile_steps < 0:
            raise UserError(f"--profile-steps {self.profile_steps}: use 0 (off) or more")
        if self.noise_every is not None and self.noise_every < 0:
            raise UserError(f"--noise-every {self.noise_every}: use 0 (off) or a number of steps")
        if not 0 <= self.noise_smoothing < 1:  # NaN too
            raise UserError(f"--noise-smoothing {self.noise_smoothing:g}: use a number from 0 (none) up to, not "
                            "including, 1")
        if self.eval_every < 0:
            raise UserError(f"--eval-every {self.eval_every}: use 0 (each epoch's end only) or a number of steps")


MAX_TIMEOUT = 30 * 24 * 3600  # seconds: --dist-timeout
MAX_THREADS = 1024  # intra-op threads per rank: more than the hardware threads of today's largest hosts


@dataclass(frozen=True, kw_only=True)
class StrategyConfig:
    strategy: str = opt("ddp", "distributed strategy (see `scale-ocr strategies`), or auto: the fastest predicted "
                        "to fit in each device's memory")
    device_memory_gb: float | None = opt(None, "memory per rank that --strategy auto plans for (default: the GPU's; "
                                         "on CPU, host RAM divided by the local ranks)")
    ds_config: str | None = opt(None, "DeepSpeed JSON; \"auto\" values are filled from this run's config",
                                aliases=("--deepspeed_config", "--deepspeed-config"))
    backend: str | None = opt(None, "process-group backend (default: nccl on GPU, gloo on CPU)",
                              choices=("nccl", "gloo"))
    nvme_path: str | None = opt(None, "directory for the swap files of NVMe offload (zero3_nvme, or \"nvme_path\": "
                                "\"auto\" in a DeepSpeed JSON); default OUTPUT_DIR/nvme, removed when the run ends "
                                "(a directory given here is kept)")
    shard_size: int | None = opt(None, "ranks each model copy is sharded over under hsdp and zero3_hpz (ZeRO++ hpZ's "
                                 "partition size): replicated across the world size / N groups; default: the "
                                 "launcher's ranks per node; the world size must be a multiple of it", metavar="N")
    threads: int | None = opt(None, "intra-op threads per CPU rank (default: $OMP_NUM_THREADS when you set it, else "
                              "the host's cores divided by the ranks on it)")
    dist_timeout: float = opt(300.0, "seconds a rank may stop responding before the job ends with a line naming it "
                              "(a stopped, hung or killed process); collectives time out a little later")
    compile: str | None = opt(None, "torch.compile the model (strategies that support it: single, ddp, fsdp); a bare "
                              "--compile uses inductor, --compile aot_eager traces without generating code (to tell "
                              "a compiler problem from a model one)", nargs="?", const="inductor",
                              choices=COMPILE_BACKENDS, metavar="BACKEND")
    bucket_mb: float = opt(25.0, "DDP's gradient all-reduce bucket size in MB (torch's bucket_cap_mb; DeepSpeed's "
                           "buckets are set in its JSON)")
    static_graph: bool = opt(False, "tell DDP the graph is the same at every step (torch's static_graph), which "
                             "lets it skip its per-step search for unused parameters",
                             action=argparse.BooleanOptionalAction)

    def __post_init__(self) -> None:
        _require_finite(self, "device_memory_gb", "dist_timeout", "bucket_mb")
        if self.bucket_mb <= 0:
            raise UserError(f"--bucket-mb {self.bucket_mb}: give DDP's bucket size in MB, e.g. 25")
        if not 5 <= self.dist_timeout <= MAX_TIMEOUT:  # a timedelta holds up to about 8.6e13 seconds
            raise UserError(f"--dist-timeout {self.dist_timeout:g}: use at least 5 seconds and at most {MAX_TIMEOUT} "
                            "(30 days)")
        if self.shard_size is not None and self.shard_size < 1:
            raise UserError(f"--shard-size {self.shard_size}: use 1 or more ranks per shard group (or leave it out "
                            "for the ranks per node)")
        if self.threads is not None and not 1 <= self.threads <= MAX_THREADS:
            raise UserError(f"--threads {self.threads}: use 1 to {MAX_THREADS} (or leave it out for cores / local "
                            "ranks)")
        _require_paths(self, "ds_config", "nvme_path")
        if self.device_memory_gb is not None and self.device_memory_gb <= 0:
            raise UserError(f"--device-memory-gb {self.device_memory_gb}: give the memory per rank in GB, e.g. 80")


@dataclass(frozen=True, kw_only=True)
class OutputConfig:
    output_dir: str = opt("runs/latest", "run directory: resolved config, metrics, models",
                          aliases=("--output_dir",))

    def __post_init__(self) -> None:
        _require_paths(self, "output_dir")


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    save_every: int = opt(0, "save a resumable checkpoint every N optimizer steps and at the end (0: by time only, "
                          "see --save-minutes)")
    save_minutes: float = opt(10.0, "also save a checkpoint whenever this many minutes of training passed since the "
                              "last one, so a killed long run loses at most that much, and one at the end of every "
                              "run (0 and --save-every 0: no checkpoints)")
    resume: str = opt("auto", "`auto`: continue this output dir's run from its latest checkpoint when it has one; "
                      "`none`: start afresh (an earlier run there is moved aside); or a checkpoint path")
    keep_last: int = opt(3, "keep only the newest K checkpoints (0 keeps all)")

    def __post_init__(self) -> None:
        if self.save_every < 0 or self.keep_last < 0:
            raise UserError("--save-every and --keep-last must be 0 or more")
        _require_finite(self, "save_minutes")
        if self.save_minutes < 0:
            raise UserError(f"--save-minutes {self.save_minutes}: use 0 (off) or a positive number of minutes")
        _require_paths(self, "resume")


@dataclass(frozen=True, kw_only=True)
class LoggingConfig:
    wandb_mode: str = opt("auto", "W&B mode; auto = $WANDB_MODE, else online with an API key and offline without",
                          choices=("auto", "online", "offline", "disabled"))
    wandb_project: str = opt("scale-ocr", "W&B project ($WANDB_PROJECT wins when set)")
    wandb_entity: str | None = opt(None, "W&B entity (team or user)")
    wandb_group: str | None = opt(None, "W&B group, e.g. one per benchmark sweep")
    wandb_tags: tuple[str, ...] = opt((), "W&B tags", nargs="+", metavar="TAG")
    run_name: str | None = opt(None, "W&B run name (default: W&B's generated name)")


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "data": DataConfig,
    "optim": OptimConfig,
    "train": TrainConfig,
    "strategy": StrategyConfig,
    "output": OutputConfig,
    "logging": LoggingConfig,
    "checkpoint": CheckpointConfig,
}


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """The whole run: one section per component; each component receives only its own."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def __post_init__(self) -> None:
        # Checks across sections that need no registry; defaults that depend on the model's task and registry
        # entry are filled in once, above the registries, by scale_ocr.run.resolve.resolve.
        accumulates = f"--grad-accum {self.train.grad_accum}" if self.train.grad_accum > 1 else (
            "--batch-ramp auto (it grows the batch by accumulation)" if self.train.batch_ramp != "off" else None)
        if self.strategy.static_graph and accumulates:  # torch 2.14: an internal assert in backward
            raise UserError(f"--static-graph cannot be combined with {accumulates}: DDP's static graph does not "
                            "support skipping the all-reduce between micro-batches; drop one of them")
        if self.data.batch_pixels and self.model.max_width is None:
            raise UserError("--batch-pixels fills micro-batches by the width each crop is read at, which --max-width "
                            "PX turns on; add --max-width, or drop --batch-pixels for -b crops a micro-batch")
        if self.data.width_bucket and not self.data.batch_pixels:
            raise UserError("--width-bucket pads the micro-batches --batch-pixels fills; add --batch-pixels or drop it")
        if self.data.batch_pixels and (self.train.batch_ramp != "off" or self.train.noise_every):
            raise UserError("--batch-pixels varies the crops a micro-batch holds, and the noise scale (--noise-every, "
                            "--batch-ramp auto) compares batches of fixed sizes; drop one of them")

    def to_dict(self) -> dict[str, Any]:
        """The resolved configuration as plain JSON-ready data."""
        return dataclasses.asdict(self)

    @classmethod
    def from_flat(cls, values: dict[str, Any]) -> RunConfig:
        """Build from a flat ``{field_name: value}`` mapping (CLI namespace or a flat file), unresolved: task and
        model defaults are still None until :func:`scale_ocr.run.resolve.resolve`."""
        sections = {}
        for name, section in SECTIONS.items():
            names = {f.name for f in dataclasses.fields(section)}
            sections[name] = section(**{k: v for k, v in values.items() if k in names})
        return cls(**sections)
