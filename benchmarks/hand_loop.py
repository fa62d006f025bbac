"""The textbook training loop scale_ocr's trainer is measured against (``python -m benchmarks.overhead``).

    python benchmarks/hand_loop.py --engine single ...
    torchrun --nproc_per_node 2 benchmarks/hand_loop.py --engine ddp|fsdp|fairscale ...
    deepspeed --num_gpus 2 benchmarks/hand_loop.py --engine zero2|zero3 ...

Written the way the engines' own tutorials drive them, and deliberately not through scale_ocr: the same
model (``create_model``) and the same words (a ``--data-cache`` file of pre-rendered ones, or a docTR
recognition ``--folder`` decoded and resized per sample as docTR's reference scripts do, normalised per
batch), read with a plain ``DataLoader`` and ``DistributedSampler``, then forward, CTC loss (the model's), \
backward, optimizer step,
nothing else: no clipping, no schedule, no metering, no logging, no checks. DeepSpeed gets the preset JSON
scale_ocr ships for the same name, so both sides run the same engine settings. The first ``--warmup``
steps are not timed, like the trainer's; rank 0 writes samples/s of the rest to ``--out``.

The convergence benchmark (``python -m benchmarks.convergence``) runs it as the bare textbook CRNN recipe:
``--sched onecycle --lr 3e-3`` (torch's OneCycleLR over the run) and ``--val-folder V --eval-every N``, which
measures exact match on V every N steps and at the end (greedy CTC decoding, each rank a share of V) and
appends ``{"step", "time", "exact_match"}`` lines to ``--curve``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[0] = str(REPO)  # import scale_ocr's model registry from this checkout, not benchmarks/

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.utils.data import DataLoader, Dataset, DistributedSampler  # noqa: E402

ENGINES = ("single", "ddp", "fsdp", "fairscale", "zero2", "zero3")


class CachedWords(Dataset):
    def __init__(self, path: str) -> None:
        data = torch.load(path, weights_only=True)
        self.images, self.labels = data["images"], data["labels"]
        self.index = {c: i + 1 for i, c in enumerate(data["chars"])}  # 0 is CTC's blank

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        return self.images[i].float(), torch.tensor([self.index[c] for c in self.labels[i]])


class FolderWords(Dataset):
    """A docTR recognition folder (images/, labels.json), read the way docTR's RecognitionDataset does: decode to a
    float tensor, resize keeping the aspect ratio, pad with zeros; no augmentation."""

    def __init__(self, root: str, chars: str, size: tuple[int, int]) -> None:
        self.root, self.size = Path(root), size
        self.items = sorted(json.loads((self.root / "labels.json").read_text(encoding="utf-8")).items())
        self.index = {c: i + 1 for i, c in enumerate(chars)}

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int):
        from PIL import Image
        from torchvision.transforms.v2 import functional as F

        name, word = self.items[i]
        with Image.open(self.root / "images" / name) as img:
            x = F.pil_to_tensor(img.convert("RGB")).float() / 255
        h, w = self.size
        scale = min(h / x.shape[1], w / x.shape[2])
        x = F.resize(x, [max(1, round(x.shape[1] * scale)), max(1, round(x.shape[2] * scale))], antialias=True)
        x = torch.nn.functional.pad(x, (0, w - x.shape[2], 0, h - x.shape[1]))
        return x, torch.tensor([self.index[c] for c in word])


def collate(items):
    images, targets = zip(*items, strict=True)
    lengths = torch.tensor([len(t) for t in targets])
    return torch.stack(images), torch.nn.utils.rnn.pad_sequence(targets, batch_first=True), lengths


def greedy_words(logits: torch.Tensor, chars: str) -> list[str]:
    """Best path: argmax per frame, merge repeats, drop blanks (class 0)."""
    words = []
    for seq in logits.argmax(-1).tolist():
        words.append("".join(chars[i - 1] for i, prev in zip(seq, [0, *seq[:-1]], strict=True) if i and i != prev))
    return words


@torch.no_grad()
def exact_match(net: torch.nn.Module, data: Dataset, chars: str, labels: list[str], rank: int, world: int,
                device: torch.device, norm) -> float:
    """Share ``rank::world`` of ``data`` through ``net`` (the unwrapped model), summed over ranks."""
    net.eval()
    mine = list(range(rank, len(data), world))
    correct = 0
    for i in range(0, len(mine), 64):
        images = torch.stack([data[j][0] for j in mine[i:i + 64]]).to(device)
        preds = greedy_words(net(norm(images))["logits"], chars)
        correct += sum(p == labels[j] for p, j in zip(preds, mine[i:i + 64], strict=True))
    net.train()
    total = torch.tensor([float(correct)], device=device)
    if dist.is_initialized():
        dist.all_reduce(total)
    return float(total) / len(data)


def ds_config(engine: str, batch: int, world: int) -> dict:
    cfg = json.loads((REPO / "ds_configs" / f"{engine}.json").read_text())
    if cfg["zero_optimization"].get("overlap_comm") == "auto":  # as scale-ocr resolves it: on with a GPU
        cfg["zero_optimization"]["overlap_comm"] = torch.cuda.is_available()
    cfg.update(train_micro_batch_size_per_gpu=batch, gradient_accumulation_steps=1, train_batch_size=batch * world,
               gradient_clipping=0.0, fp16={"enabled": False}, bf16={"enabled": False})
    return cfg


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--engine", choices=ENGINES, required=True)
    p.add_argument("--arch", default="crnn_mobilenet_v3_small")
    data_arg = p.add_mutually_exclusive_group(required=True)
    data_arg.add_argument("--data-cache")
    data_arg.add_argument("--folder", help="a docTR recognition folder")
    p.add_argument("--chars", help="the vocabulary (with --folder)")
    p.add_argument("--input-size", default="32x128", help="HxW (with --folder)")
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("-b", "--batch-size", type=int, default=32)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--window", type=int, default=10,
                   help="also time each N-step window after the warm-up (the trainer's --log-every windows)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--channels-last", action="store_true",
                   help="feed a convolutional model (one whose class sets channels_last) NHWC images, "
                        "as the trainer does")
    p.add_argument("--sched", choices=("constant", "onecycle"), default="constant",
                   help="onecycle: torch's OneCycleLR (max_lr=--lr) over --steps")
    p.add_argument("--val-folder", help="a docTR folder to measure exact match on (single and ddp)")
    p.add_argument("--eval-every", type=int, default=0, help="with --val-folder: steps between measurements")
    p.add_argument("--curve", help="with --val-folder: append one JSON line per measurement here")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    p.add_argument("--local_rank", type=int, default=0)  # the deepspeed launcher's
    args = p.parse_args()
    if args.val_folder and (args.engine not in ("single", "ddp") or not args.folder or not args.curve):
        p.error("--val-folder needs --engine single or ddp, --folder and --curve")
    return args


def init_process(engine: str) -> tuple[torch.device, int, int, int]:
    """This rank's device, and (local rank, rank, world size); every engine but single joins a process group."""
    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1)))
    if engine != "single":
        dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    return device, local_rank, rank, world


def words(args: argparse.Namespace, device: torch.device):
    """The training words, the validation words (or None), the input size and the batch normalisation."""
    size = tuple(int(v) for v in args.input_size.split("x"))
    mean = torch.tensor([0.485, 0.456, 0.406], device=device).view(1, 3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225], device=device).view(1, 3, 1, 1)
    if args.folder:
        data = FolderWords(args.folder, args.chars, size)
        norm = lambda x: (x - mean) / std  # noqa: E731 - docTR's batch_transforms
    else:
        data = CachedWords(args.data_cache)
        size = tuple(data.images.shape[2:])
        norm = lambda x: x  # noqa: E731 - cached words are normalised already
    val = FolderWords(args.val_folder, args.chars, size) if args.val_folder else None
    return data, val, size, norm


def wrap(model: torch.nn.Module, args: argparse.Namespace, rank: int, world: int, local_rank: int):
    """The model and optimizer as each engine's own tutorial sets them up."""
    if args.engine.startswith("zero"):
        import deepspeed

        model, optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=args.lr),
            config=ds_config(args.engine, args.batch_size, world), dist_init_required=False)
        from scale_ocr.strategies.deepspeed import release_shm_buffer

        release_shm_buffer(rank)  # DeepSpeed never removes its /dev/shm files
        return model, optimizer
    if args.engine == "fairscale":
        from fairscale.nn.data_parallel import ShardedDataParallel
        from fairscale.optim import OSS

        optimizer = OSS(model.parameters(), optim=torch.optim.AdamW, lr=args.lr)
        return ShardedDataParallel(model, optimizer), optimizer
    if args.engine == "ddp":
        cuda = torch.cuda.is_available()
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local_rank] if cuda else None)
    elif args.engine == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for block in (model.sharding_units() if hasattr(model, "sharding_units") else model.children()):
            if any(p.requires_grad for p in block.parameters()):
                fully_shard(block)
        fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=args.lr)


def record_exact_match(args: argparse.Namespace, model, val: FolderWords, step: int, rank: int, world: int,
                       device: torch.device, norm) -> None:
    """Exact match on ``--val-folder`` (each rank a share), appended by rank 0 to ``--curve``."""
    net = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    em = exact_match(net, val, args.chars, [word for _, word in val.items], rank, world, device, norm)
    if rank == 0:
        with open(args.curve, "a", encoding="utf-8") as f:
            f.write(json.dumps({"step": step, "time": round(time.time(), 3), "exact_match": em}) + "\n")


def main() -> None:
    args = parse_args()
    from scale_ocr.distributed.extensions import use_environment_extensions
    from scale_ocr.models import create_model

    use_environment_extensions()  # the DeepSpeed ops `make install` built, as the trainer finds them: no compiling
    device, local_rank, rank, world = init_process(args.engine)
    cuda = device.type == "cuda"
    data, val, size, norm = words(args, device)
    torch.manual_seed(args.seed)
    model = create_model(args.arch, num_classes=len(data.index) + 1, input_size=size).to(device)
    layout = (torch.channels_last if args.channels_last and getattr(model, "channels_last", False)
              else torch.contiguous_format)
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler, drop_last=True, collate_fn=collate,
                        num_workers=args.workers, persistent_workers=args.workers > 0, pin_memory=cuda)
    model, optimizer = wrap(model, args, rank, world, local_rank)
    sched = (torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=args.steps)
             if args.sched == "onecycle" else None)

    # The loop: forward, loss, backward, step; nothing else but the timing marks and the optional validation.
    model.train()
    step, epoch = 0, 0
    marks = {0: time.perf_counter()} if args.warmup == 0 else {}  # step -> time: the warm-up's end, every --window
    while step < args.steps:
        sampler.set_epoch(epoch)
        for images, targets, lengths in loader:
            images, targets, lengths = images.to(device), targets.to(device), lengths.to(device)
            images = norm(images).contiguous(memory_format=layout)
            loss = model(images, targets, lengths)["loss"]
            if args.engine.startswith("zero"):
                model.backward(loss)
                model.step()
            else:
                loss.backward()
                optimizer.step()
                # fairscale's buckets hold the gradients: its tutorial clears them through the model
                (model if args.engine == "fairscale" else optimizer).zero_grad()
            if sched is not None:
                sched.step()
            step += 1
            if val is not None and (step == args.steps or (args.eval_every and step % args.eval_every == 0)):
                record_exact_match(args, model, val, step, rank, world, device, norm)
            if step == args.warmup or step % args.window == 0:
                if cuda:
                    torch.cuda.synchronize()
                marks[step] = time.perf_counter()
            if step == args.steps:
                break
        epoch += 1
    if cuda:
        torch.cuda.synchronize()
    if rank == 0:
        write_summary(args, marks, time.perf_counter(), world, float(loss.detach()))
    if dist.is_initialized():
        dist.destroy_process_group()


def write_summary(args: argparse.Namespace, marks: dict[int, float], end: float, world: int, last_loss: float) -> None:
    """Samples/s over the steps after the warm-up (to ``end``), and of each ``--window`` steps, into ``--out``."""
    seconds = end - marks[args.warmup]
    timed = args.steps - args.warmup
    windows = [args.window * args.batch_size * world / (marks[s + args.window] - marks[s])
               for s in sorted(marks) if s >= args.warmup and s % args.window == 0 and s + args.window in marks]
    Path(args.out).write_text(json.dumps({
        "samples_per_sec": timed * args.batch_size * world / seconds, "timed_steps": timed, "seconds": seconds,
        "window_samples_per_sec": windows, "last_loss": last_loss, "world_size": world}) + "\n")


if __name__ == "__main__":
    main()
