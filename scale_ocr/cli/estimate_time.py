"""``scale-ocr estimate-memory --time``: step time per strategy beside its memory, and ``--scaling`` from 1 to 1,024
devices. The model is :mod:`scale_ocr.planning.time_model`; this module is its flags, inputs and tables."""

from __future__ import annotations

import argparse
import math
import os
from typing import Any

from scale_ocr.errors import UserError

CURVE = tuple(2**k for k in range(11))  # 1 ... 1,024 devices


def add_time_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("step time (--time, --scaling)")
    g.add_argument("--time", action="store_true", help="also predict each strategy's step time at --batch-size per "
                   "device: counted FLOPs at the device's peak x --mfu, bytes moved over the links, Adam's step")
    g.add_argument("--scaling", action="store_true", help="predicted step time and scaling efficiency of each "
                   "strategy from 1 to 1,024 devices on the stated cluster (implies --time)")
    add_cluster_args(g)
    g.add_argument("--flops-per-sample", type=float, default=None,
                   help="with --params: a training sample's FLOPs, forward and backward (--model counts them)")


def add_cluster_args(g) -> None:
    """The cluster the time model predicts for: a device kind, its links and MFU, or this host measured."""
    g.add_argument("--device", default="host", help="h100, a100, h200, v100, l4, mi300x, or host: this machine's "
                   "CPU, measured (the model's own FLOP/s at a rank's threads, memory bandwidth; a few seconds)")
    g.add_argument("--mfu", type=float, default=None, help="model FLOPs utilisation assumed on a GPU (default 0.4); "
                   "with --device host the measured rate is used as is")
    g.add_argument("--link", default=None, help="the link within a node: nvlink4, nvlink3, pcie5, pcie4, ... "
                   "(default nvlink4 on GPUs), or host: a gloo all-reduce between two local processes, measured")
    g.add_argument("--inter-link", default="ib400", help="the link between nodes (ib400, ib200, eth100, eth25, ...)")
    g.add_argument("--per-node", type=int, default=8, help="devices per node (default 8)")
    g.add_argument("--no-engine-probe", action="store_true", help="with --device host, skip the short one-rank "
                   "training run of each strategy that measures its own step (hooks, casts, copies: what FLOPs miss; "
                   "5-20 s each) and predict from the model's FLOPs alone")


def wants_time(args: argparse.Namespace) -> bool:
    return bool(args.time or args.scaling)


def workload(args: argparse.Namespace, task, size) -> Any:
    from scale_ocr.planning.time_model import Workload

    units = modules = persistent = persistent_numel = 0
    if task is not None:
        from scale_ocr.run.flops import flops_per_sample

        count = flops_per_sample(task.create_model, task.dummy_inputs, args.precision)
        fwd, bwd = count.forward, count.backward
        units, modules, persistent, persistent_numel = _granularity(task)
    elif args.flops_per_sample:
        fwd, bwd = args.flops_per_sample / 3, args.flops_per_sample * 2 / 3  # the backward is about twice the forward
    else:
        raise UserError("--time with --params needs --flops-per-sample (or give --model, whose FLOPs are counted)")
    return Workload(fwd, bwd, args.batch_size, size.params, size.largest_layer, args.precision,
                    args.activation_checkpointing, units, modules, persistent, persistent_numel)


# The zero3 presets' stage-3 settings (ds_configs/zero3*.json), in elements: weights up to PERSISTENT are kept whole
# (and gathered one by one after each step), fetches are coalesced up to PREFETCH, and gathered weights that the
# backward reuses within REUSE are kept from the forward.
PERSISTENT, PREFETCH, REUSE = 10_000, 5_000_000, 5_000_000


def _granularity(task) -> tuple[int, int, int, int]:
    """FSDP's sharding units (plus the root), ZeRO-3's all-gathers a step, and the weights it keeps whole (count,
    elements), of ``task``'s model built on the meta device. ZeRO-3's gathers, as the scaling record's traces
    count them: a model whose partitioned weights fit in REUSE is gathered once a step, in PREFETCH-sized calls
    (crnn_mobilenet_v3_small, db_mobilenet_v3_large: 1); a larger one module by module in the forward and in
    PREFETCH-sized calls in the backward (vitstr_small: 56 modelled, 43 counted)."""
    import torch

    from scale_ocr.models.registry import capable

    with torch.device("meta"):
        model = task.build_model()
    units = model.sharding_units() if capable(model, "sharding_units") else list(model.children())
    modules = [m for m in model.modules() if any(p.numel() > PERSISTENT for p in m.parameters(recurse=False))]
    small = [p.numel() for p in model.parameters() if p.numel() <= PERSISTENT]
    partitioned = sum(p.numel() for p in model.parameters()) - sum(small)
    bucketed = math.ceil(partitioned / PREFETCH)
    gathers = bucketed if partitioned <= REUSE else len(modules) + bucketed
    return len(units) + 1, max(1, gathers), len(small), sum(small)


def cluster_for(args: argparse.Namespace, task, work, names: list[str]) -> tuple[Any, float, str, dict[str, Any]]:
    """The cluster, the MFU that applies, a line on where the figures come from, and (on this host) each engine's
    measured one-rank step."""
    from scale_ocr.planning import time_model as tm

    # --per-node and --mfu are in range: estimate_memory.check_numbers
    if args.device != "host":
        intra = tm.link(args.link or "nvlink4")
        cluster = tm.Cluster(tm.device(args.device), intra, tm.link(args.inter_link), args.per_node)
        mfu = args.mfu or 0.4
        return cluster, mfu, f"MFU {mfu:g} assumed", {}
    return _host_cluster(args, task, work, names)


def _host_cluster(args: argparse.Namespace, task, work, names: list[str]) -> tuple[Any, float, str, dict[str, Any]]:
    """This CPU host, measured: the model's FLOP/s at a rank's threads on one rank and at ``--world-size``, memory
    bandwidth, gloo between two local processes (``--link host``, the default here), and each engine's own step
    on one rank (unless ``--no-engine-probe``)."""
    from dataclasses import replace

    from scale_ocr.planning import host_probe
    from scale_ocr.planning import time_model as tm

    if task is None:
        raise UserError("--device host measures the model's own speed here; give --model (or a --device from the "
                        "table)")
    if args.link not in (None, "host"):
        raise UserError(f"--device host runs over gloo on this machine; drop --link {args.link} (or give a GPU "
                        "--device)")
    threads = max(1, (os.cpu_count() or 1) // min(args.world_size, os.cpu_count() or 1))
    ranks = min(args.world_size, 8)  # a job's local ranks share the host: they step at once
    per_sample = work.flops_forward + work.flops_backward
    flops = host_probe.compute_rate(task, args.batch_size, args.precision, threads, per_sample, ranks=ranks)
    alone = flops if ranks == 1 else host_probe.compute_rate(task, args.batch_size, args.precision, threads, per_sample)
    bandwidth, latency, busy = host_probe.gloo_link(2)
    memory = host_probe.memory_bandwidth(threads=threads)
    cluster = tm.with_host(tm.Cluster(tm.DEVICES["h100"], tm.LINKS["nvlink4"], tm.LINKS["nvlink4"], args.per_node),
                           flops, memory, bandwidth, latency, busy)
    engines, unmeasured = {}, {}
    for name in [] if args.no_engine_probe else names:
        try:
            cost = host_probe.engine_cost(name, task.cfg, args.batch_size, args.precision, threads)
        except UserError as exc:  # predicted from its FLOPs alone, and said so
            unmeasured[name] = str(exc)
            continue
        engines[name] = replace(cost, scale=alone / flops)
    why = (f"measured here: {flops / 1e9:.1f} GFLOP/s per rank at {threads} thread(s), {ranks} rank(s) at once "
           f"({alone / flops:.2f}x one rank's time), memory {memory / 1e9:.1f} GB/s, gloo {bandwidth / 1e9:.2f} GB/s + "
           f"{latency * 1e3:.2f} ms per call ({busy * 1e3:.2f} ms between a layer's compute); "
           + (f"each engine's own step measured on one rank ({', '.join(engines)})" if engines
              else "engines' host work not measured (--no-engine-probe)" if args.no_engine_probe else "")
           + "".join(f"; {reason} - {name} is predicted from its FLOPs alone" for name, reason in unmeasured.items()))
    return cluster, 1.0, why, engines


def time_document(args: argparse.Namespace, task, size, names: list[str]) -> dict[str, Any]:
    """Per-strategy step times at ``--world-size`` and, with ``--scaling``, at every size of :data:`CURVE`."""
    from scale_ocr.planning.estimate import build_strategy
    from scale_ocr.planning.time_model import predict_step

    work = workload(args, task, size)
    cluster, mfu, source, engines = cluster_for(args, task, work, names)

    def layout(name: str, world: int):
        strategy, ranks = build_strategy(name, world, args.precision, args.ds_config, min(args.per_node, world))
        return strategy.state_layout(), ranks

    rows = {}
    for name in names:
        lay, ranks = layout(name, args.world_size)
        rows[name] = predict_step(lay, work, ranks, cluster, mfu, engines.get(name)).as_dict()
        rows[name]["samples_per_s"] = work.batch * ranks / rows[name]["step_s"]
    doc: dict[str, Any] = {"cluster": cluster.describe(), "source": source, "mfu": mfu, "batch_per_device": work.batch,
                           "flops_per_sample": work.flops_forward + work.flops_backward,
                           "flops_counted": task is not None, "strategies": rows}
    if engines:
        doc["engines_one_rank"] = {name: vars(e) for name, e in engines.items()}
    if args.scaling:
        curve: dict[str, dict[int, float]] = {}
        for name in names:
            points = {}
            for n in CURVE:
                try:
                    lay, ranks = layout(name, n)
                except UserError:  # e.g. zero3_hpz on one rank per node
                    continue
                if ranks == n:
                    points[n] = predict_step(lay, work, n, cluster, mfu, engines.get(name)).total
            curve[name] = points
        doc["scaling"] = curve
    return doc


def row(first: str, cells: list[str], widths: list[int]) -> str:
    """A table line: ``first`` left in 14 characters, each cell right-aligned in its width, and a cell as wide as
    its column or wider still set off by a space, so numbers never run together."""
    return f"{first:<14}" + "".join(c.rjust(w) if len(c) < w else " " + c for c, w in zip(cells, widths, strict=True))


def format_time(doc: dict[str, Any]) -> str:
    widths = [9, 9, 8, 9, 8, 8, 9, 11]
    counted = "counted" if doc.get("flops_counted", True) else "given"
    lines = [f"Predicted step time per rank, {doc['batch_per_device']} samples per device, "
             f"{doc['flops_per_sample'] / 1e9:.3g} GFLOP per sample ({counted}): {doc['cluster']}; {doc['source']}",
             row("strategy", ["compute", "comm MB", "comm", "exposed", "optim", "other", "step", "samples/s"], widths)
             + "   (times in ms)"]
    for name, r in doc["strategies"].items():
        mb = r["comm_bytes"] / 1e6
        times = ("compute_s", "comm_s", "exposed_comm_s", "optimizer_s", "other_s", "step_s")
        ms = [f"{r[k] * 1e3:.3g}" for k in times]
        lines.append(row(name, [ms[0], f"{mb:.1f}" if mb < 1e6 else f"{mb:.3g}", *ms[1:], f"{r['samples_per_s']:.0f}"],
                         widths))
    if "scaling" in doc:
        lines.append("Predicted scaling (a prediction, not a measurement): step ms, and in brackets the efficiency "
                     "T(1)/T(n) at a fixed per-device batch")
        lines.append(row("strategy", [str(n) for n in CURVE], [13] * len(CURVE)))
        for name, points in doc["scaling"].items():
            base = points.get(1) or next(iter(points.values()), None)
            cells = [f"{points[n] * 1e3:.3g} ({base / points[n]:.2f})" if n in points else "-" for n in CURVE]
            lines.append(row(name, cells, [13] * len(CURVE)))
    return "\n".join(lines)
