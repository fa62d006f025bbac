"""``scale-ocr verify``: check that switching strategy leaves the training maths alone.

Each strategy trains the same model from the same seed, data order and global batch as a real multi-process job;
losses and global grad norms per step and the final parameters are compared with a reference strategy (DDP by
default). The tolerances are not zero: engines reduce gradients in different orders (sum then divide, or divide
then sum), and Adam's first updates turn last-bit differences of near-zero gradients into whole steps. Grad norms
are compared over the first NORM_STEPS steps, where a lost accumulation or loss scale shows as a factor; losses
and final parameters over the whole run, where a wrong rate, schedule or clip shows. ``single`` is no reference for
models with BatchNorm: one process computes batch statistics over the global batch, N ranks over their shards.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from scale_ocr.distributed.process_group import free_port
from scale_ocr.errors import UserError, say

DEFAULT_STRATEGIES = "ddp,fsdp,fsdp_grad_op,zero1,zero2,zero3,fairscale"
LOSS_RTOL = 1e-2  # relative, per logged step
NORM_RTOL = 1e-1  # relative, per step over the first NORM_STEPS (the grad norm amplifies last-bit noise most)
NORM_STEPS = 5
PARAM_RTOL = 1e-2  # relative L2 distance of all parameters after the last step
# (Not a max-abs bound: Adam's update is about lr per element whatever the gradient's size, so an
# element whose gradient is ~0 can move by lr in either direction from last-bit noise alone.)
TRAIN_PY = Path(__file__).resolve().parents[1] / "train.py"  # scale_ocr/train.py, the launch script


@dataclass
class RunResult:
    losses: list[float]
    norms: list[float]
    params: dict[str, torch.Tensor]


@dataclass
class Row:
    strategy: str
    loss_diff: float
    norm_diff: float
    param_diff: float
    error: str | None = None

    @property
    def passed(self) -> bool:
        return self.error is None and self.loss_diff <= LOSS_RTOL and self.norm_diff <= NORM_RTOL \
            and self.param_diff <= PARAM_RTOL


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="scale-ocr verify", description=__doc__.split("\n\n")[0])
    p.add_argument("arch", nargs="?", default="crnn_mobilenet_v3_small")
    p.add_argument("--strategies", default=DEFAULT_STRATEGIES, help="comma-separated strategy names")
    p.add_argument("--reference", default="ddp", help="the strategy the others are compared with")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--nodes", type=int, default=1, help="simulate this many nodes on this host: one torchrun agent "
                   "each (--nnodes, --node_rank), world size / nodes ranks per node; hsdp and zero3_hpz shard "
                   "within a node")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("-b", "--batch-size", type=int, default=4, help="per-rank micro-batch")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--input-size", default=None, metavar="HxW",
                   help="model input (default: the model's task's; e.g. 128x128 keeps a DBNet check quick on CPU)")
    p.add_argument("--max-width", type=int, default=None, metavar="PX",
                   help="recognizers: read the words at their own width, up to PX (train.py's --max-width): batches "
                        "of several widths, padded")
    p.add_argument("--output-dir", default=None, help="keep the runs here (default: a temporary folder)")
    p.add_argument("--extra", action="append", default=[], metavar="STRATEGY=ARGS",
                   help="extra train.py flags for one strategy, e.g. zero2='--lr 2e-3' (experiments, tests)")
    return p


def _train(strategy: str, args, out: Path, extra: list[str]) -> RunResult:
    n = args.steps
    train = [str(TRAIN_PY), args.arch, "--strategy", strategy, "--max-steps", str(n), "--epochs", "1",
             "-b", str(args.batch_size), "--train-samples", str(n * args.batch_size * args.world_size),
             "--val-samples", "8", "--max-chars", "5", "--no-augment", "--log-every", "1", "--lr", str(args.lr),
             "--seed", "0", "--save-every", str(n), "--keep-last", "1", "--wandb-mode", "disabled",
             "--resume", "none", "--output-dir", str(out),
             *(["--input-size", args.input_size] if args.input_size else []),
             *(["--max-width", str(args.max_width)] if args.max_width else []), *extra]
    logs = Path(tempfile.mkdtemp(prefix=f"{strategy}-output-", dir=out.parent))  # a folder no other run has
    returncode, output = _launch(train, args.world_size, args.nodes, logs)
    if returncode != 0:
        tail = [ln for ln in output.splitlines() if "Error" in ln or "error:" in ln][-1:] or ["failed"]
        raise RuntimeError(f"{tail[0][:200]} (output: {logs})")
    shutil.rmtree(logs)
    records = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "train/loss" in r]
    from scale_ocr.checkpoint.export import load_checkpoint_model

    # Parameters only: BatchNorm running statistics legitimately differ (DDP broadcasts rank 0's
    # buffers every forward, sharded engines keep each rank's own), and they do not enter training.
    params = {k: v.detach().float() for k, v in load_checkpoint_model(out).model.named_parameters()}
    return RunResult([r["train/loss"] for r in steps], [r["train/grad_norm"] for r in steps], params)


def _launch(train: list[str], world: int, nodes: int, logs: Path) -> tuple[int, str]:
    """``train`` under one torchrun agent per simulated node on 127.0.0.1 (their output in ``logs/nodeN.log``,
    files, so no unread pipe can block a rank); the first failing exit status (0 if none) and the output.

    Agents of a failed job that are still running a minute later (peers waiting in a collective until the
    watchdog ends them) are killed with their ranks: each agent leads its own process group."""
    port = free_port()
    procs = []
    for node in range(nodes):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--node_rank", str(node),
               "--nproc_per_node", str(world // nodes), "--master_addr", "127.0.0.1", "--master_port", str(port),
               *train]
        with open(logs / f"node{node}.log", "x", encoding="utf-8") as log:
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    deadline = None
    while any(p.poll() is None for p in procs):
        failed = any(p.returncode for p in procs if p.returncode is not None)
        deadline = deadline or (time.monotonic() + 60 if failed else None)
        if deadline and time.monotonic() > deadline:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
        time.sleep(0.2)
    codes = [p.wait() for p in procs]
    output = "\n".join((logs / f"node{node}.log").read_text(encoding="utf-8", errors="replace")
                       for node in range(nodes))
    return next((c for c in codes if c), 0), output


def _rel(a: list[float], b: list[float]) -> float:
    if len(a) != len(b):
        return float("inf")
    return max((abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b, strict=True)), default=0.0)


def compare(name: str, ours: RunResult, ref: RunResult) -> Row:
    keys = sorted(ref.params)
    a = torch.cat([ours.params[k].flatten() for k in keys])
    b = torch.cat([ref.params[k].flatten() for k in keys])
    param_diff = float((a - b).norm() / b.norm().clamp(min=1e-12))
    return Row(name, _rel(ours.losses, ref.losses), _rel(ours.norms[:NORM_STEPS], ref.norms[:NORM_STEPS]), param_diff)


def format_table(rows: list[Row], reference: str) -> str:
    lines = [f"{'strategy':<15} {'max loss rel':>13} {'max norm rel':>13} {'params rel L2':>14}  result",
             f"{'-' * 15} {'-' * 13} {'-' * 13} {'-' * 14}  ------"]
    for r in rows:
        if r.error:
            lines.append(f"{r.strategy:<15} {'':>13} {'':>13} {'':>14}  ERROR {r.error}")
        else:
            verdict = "reference" if r.strategy == reference else ("pass" if r.passed else "FAIL")
            lines.append(f"{r.strategy:<15} {r.loss_diff:>13.2e} {r.norm_diff:>13.2e} {r.param_diff:>14.2e}  {verdict}")
    lines.append(f"tolerances: loss rel {LOSS_RTOL:g} (every step), grad norm rel {NORM_RTOL:g} (steps "
                 f"1-{NORM_STEPS}), "
                 f"params rel L2 {PARAM_RTOL:g} (after the last step)")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.nodes < 1 or args.world_size < 1 or args.world_size % args.nodes:
        raise UserError(f"--world-size {args.world_size} is not a multiple of --nodes {args.nodes}; give each "
                        "simulated node the same number of ranks")
    names = [s for s in args.strategies.split(",") if s]
    extras = dict(e.split("=", 1) for e in args.extra)
    order = [args.reference] + [s for s in names if s != args.reference]
    root = Path(args.output_dir) if args.output_dir else Path(tempfile.mkdtemp(prefix="scale-ocr-verify-"))
    root.mkdir(parents=True, exist_ok=True)
    where = f"{args.world_size} ranks" + (f" ({args.nodes} nodes x {args.world_size // args.nodes})"
                                          if args.nodes > 1 else "")
    results: dict[str, RunResult] = {}
    rows: list[Row] = []
    for name in order:
        say(f"scale-ocr verify: training {name} on {where} for {args.steps} steps")
        try:
            results[name] = _train(name, args, root / name, shlex.split(extras.get(name, "")))
        except RuntimeError as exc:
            rows.append(Row(name, float("nan"), float("nan"), float("nan"), str(exc)))
            continue
        if name != args.reference and args.reference in results:
            rows.append(compare(name, results[name], results[args.reference]))
        elif name == args.reference:
            rows.append(Row(name, 0.0, 0.0, 0.0))
    say(format_table(rows, args.reference))
    return 0 if all(r.passed for r in rows) else 1
