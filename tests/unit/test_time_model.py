"""The time model: bytes each engine moves per step, the step's parts, the scaling curve, and its flags refused."""

import contextlib
import io
import json

import pytest

from scale_ocr.cli.estimate_memory import main as _reported
from scale_ocr.planning import time_model as tm
from scale_ocr.planning.estimate import build_strategy

estimate_main = _reported.__wrapped__  # the command itself: a refusal raises its UserError here

N = 85e6  # vitstr_base's parameters, about


def _layout(name: str, world: int, precision: str = "bf16"):
    strategy, ranks = build_strategy(name, world, precision, None, min(8, world))
    return strategy.state_layout(), ranks


def test_each_engine_moves_the_ring_volumes():
    volume = {name: sum(p[1] for p in tm.comm_volumes(_layout(name, 8)[0], N, 8))
              for name in ("ddp", "fsdp", "fsdp_grad_op", "zero2", "zero3", "fairscale")}
    f = 7 / 8
    assert volume["ddp"] == pytest.approx(2 * f * 4 * N)  # fp32 gradients, all-reduced
    assert volume["fsdp"] == pytest.approx(f * (4 * N + 2 * 2 * N))  # fp32 reduce-scatter, 16-bit gathers twice
    assert volume["fsdp_grad_op"] == pytest.approx(f * (4 * N + 2 * N))  # gathered once, kept to the backward
    assert volume["zero2"] == pytest.approx(f * (2 * N + 2 * N))  # 16-bit reduce-scatter + updated-weight gather
    assert volume["zero3"] == pytest.approx(f * (2 * N + 2 * 2 * N))
    assert volume["fairscale"] == pytest.approx(f * (4 * N + 4 * N))
    assert tm.comm_volumes(_layout("ddp", 1)[0], N, 1) == []
    hsdp, _ = _layout("hsdp", 16)  # shards within 8, all-reduces its fp32 shard across the 2 groups
    phases = {p[0]: p[1] for p in tm.comm_volumes(hsdp, N, 16)}
    assert phases["all-reduce grads across groups"] == pytest.approx(2 * 0.5 * 4 * N / 8)


def test_a_step_is_compute_plus_exposed_communication_plus_the_optimizer():
    work = tm.Workload(1e9, 2e9, 32, int(N), int(2.4e6), "bf16")
    h100 = tm.DEVICES["h100"]
    gpus = tm.Cluster(h100, tm.LINKS["nvlink4"], tm.LINKS["ib400"], 8)
    ddp, _ = _layout("ddp", 8)
    step = tm.predict_step(ddp, work, 8, gpus, 0.5)
    assert step.compute == pytest.approx(3e9 * 32 / (989e12 * 0.5))
    assert step.optimizer == pytest.approx(28 * N / h100.memory_bandwidth)
    assert 0 < step.exposed < step.comm  # the all-reduce hides behind the backward, all but its last bucket
    cpu = tm.Cluster(h100, tm.LINKS["eth10"], tm.LINKS["eth10"], 8, overlap=False)
    assert tm.predict_step(ddp, work, 8, cpu, 0.5).exposed == tm.predict_step(ddp, work, 8, cpu, 0.5).comm
    across = tm.predict_step(ddp, work, 16, gpus, 0.5)
    assert across.comm > 5 * step.comm  # past one node the ring runs at the NIC's bandwidth, not NVLink's


def _json(*args: str) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert estimate_main([*args, "--json"]) == 0
    return json.loads(out.getvalue())


def test_estimate_memory_predicts_step_time_and_a_scaling_curve():
    doc = _json("--params", "85e6", "--largest-layer", "2.4e6", "--world-size", "8", "--strategies",
                "ddp,fsdp,zero2,zero3,hsdp", "--scaling", "--device", "h100", "--flops-per-sample", "6.7e10",
                "--batch-size", "64")
    time = doc["time"]
    assert set(time["strategies"]) == {"ddp", "fsdp", "zero2", "zero3", "hsdp"}
    assert all(r["step_s"] > r["compute_s"] > 0 for r in time["strategies"].values())
    curve = time["scaling"]["ddp"]
    assert [int(n) for n in curve] == [2**k for k in range(11)]
    # Within a node DDP keeps up; across nodes its all-reduce at the NIC's bandwidth shows; HSDP's does not.
    assert curve["8"] < 1.1 * curve["1"] < curve["1024"]
    assert time["scaling"]["hsdp"]["1024"] < curve["1024"]


@pytest.mark.parametrize("flags, says", [
    (["--device", "tpu9"], "unknown device 'tpu9'"),
    (["--device", "h100", "--link", "carrier-pigeon"], "unknown link 'carrier-pigeon'"),
    (["--device", "h100", "--mfu", "0"], "--mfu 0 is not a number above 0 and at most 1"),
    (["--device", "h100", "--per-node", "0"], "--per-node 0 is not a number from 1"),
    (["--device", "host"], "--device host measures the model's own speed here; give --model"),
])
def test_time_flags_are_refused_in_one_line(flags, says, capsys):
    from scale_ocr.cli.main import main

    assert main(["estimate-memory", "--params", "1e6", "--world-size", "2", "--flops-per-sample", "1e9", "--time",
                 *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0], err
    assert main(["estimate-memory", "--params", "1e6", "--world-size", "2", "--time", "--device", "h100"]) == 2
    assert "--time with --params needs --flops-per-sample" in capsys.readouterr().err


def test_a_measured_engine_step_replaces_the_flop_estimate_and_small_calls_cost_what_the_host_says():
    """On a CPU host the engines' own one-rank step (hooks, casts, copies) stands for compute, its optimizer step is
    shared as the optimizer state is, and every call pays the host's measured cost; ZeRO-3's per-weight gathers
    of its persistent weights after the step are counted one by one (128 for the CRNN, as its trace shows)."""
    from scale_ocr.cli.estimate_time import _granularity
    from scale_ocr.config import ModelConfig
    from scale_ocr.tasks import create_task

    units, gathers, persistent, small = _granularity(create_task(ModelConfig(arch="crnn_mobilenet_v3_small")))
    assert (units, gathers, persistent) == (16, 1, 128) and 0 < small < 10_000 * persistent
    work = tm.Workload(1e8, 2e8, 8, 2_000_000, 300_000, "bf16", units=units, modules=gathers, persistent=persistent,
                       persistent_numel=small)
    host = tm.with_host(tm.Cluster(tm.DEVICES["h100"], tm.LINKS["nvlink4"], tm.LINKS["nvlink4"], 8),
                        30e9, 13e9, 1.2e9, latency=0.8e-3, busy=1.3e-3)
    engine = tm.EngineCost(compute=0.100, optimizer=0.020, other=0.005, threads=1, scale=1.1)
    ddp = tm.predict_step(_layout("ddp", 2)[0], work, 2, host, 1.0, engine)
    zero2 = tm.predict_step(_layout("zero2", 2)[0], work, 2, host, 1.0, engine)
    assert ddp.compute == pytest.approx(0.110) and ddp.other == 0.005
    assert ddp.optimizer == pytest.approx(0.020) and zero2.optimizer == pytest.approx(0.010)  # half the params
    assert ddp.total == pytest.approx(ddp.compute + ddp.exposed + ddp.optimizer + ddp.other)
    fsdp = tm.predict_step(_layout("fsdp", 2)[0], work, 2, host, 1.0, engine)
    calls = sum(p["calls"] for p in fsdp.extra["phases"].values())
    assert calls == 3 * units and fsdp.comm == pytest.approx(fsdp.comm_bytes / 1.2e9 + calls * 1.3e-3)
    zero3 = tm.predict_step(_layout("zero3", 2)[0], work, 2, host, 1.0, engine)
    after = zero3.extra["phases"]["all-gather small params after the step"]
    assert after == {"bytes": pytest.approx(0.5 * 2 * small), "calls": 128}
    # Back to back, with no compute between them, those calls pay the short-call cost, not the between-layers one.
    others = sum(p["calls"] for name, p in zero3.extra["phases"].items() if name not in tm.BACK_TO_BACK)
    assert zero3.comm == pytest.approx(zero3.comm_bytes / 1.2e9 + others * 1.3e-3 + 128 * 0.8e-3)
    # Without a measured engine nothing of the host's work is assumed.
    assert tm.predict_step(_layout("ddp", 2)[0], work, 2, host, 1.0).other == 0.0


def test_an_engine_that_cannot_be_measured_here_says_why():
    from scale_ocr.config import ModelConfig
    from scale_ocr.errors import UserError
    from scale_ocr.planning.host_probe import engine_cost

    with pytest.raises(UserError, match=r"measuring no_such_engine's own step on one rank failed \(exit 2: .*no_such"):
        engine_cost("no_such_engine", ModelConfig(arch="crnn_mobilenet_v3_small"), 2, "fp32", 1, steps=2)


def test_a_strategy_whose_engine_run_fails_is_predicted_from_flops_and_the_output_says_so(monkeypatch):
    """The host's probes stand in with fixed figures here (the real ones run in test_bench's time_check test)."""
    from scale_ocr.errors import UserError
    from scale_ocr.planning import host_probe

    def engine(name, *args, **kw):
        if name == "zero2":
            raise UserError("measuring zero2's own step on one rank failed (exit 1: boom)")
        return tm.EngineCost(compute=0.5, optimizer=0.01, other=0.002, threads=1)

    monkeypatch.setattr(host_probe, "compute_rate", lambda *a, **kw: 30e9)
    monkeypatch.setattr(host_probe, "gloo_link", lambda world=2: (1.2e9, 0.8e-3, 1.3e-3))
    monkeypatch.setattr(host_probe, "memory_bandwidth", lambda **kw: 13e9)
    monkeypatch.setattr(host_probe, "engine_cost", engine)
    doc = _json("--model", "crnn_mobilenet_v3_small", "--world-size", "2", "--time", "--device", "host",
                "--strategies", "ddp,zero2", "--batch-size", "8")["time"]
    assert set(doc["engines_one_rank"]) == {"ddp"}
    assert "exit 1: boom) - zero2 is predicted from its FLOPs alone" in doc["source"]
    assert doc["strategies"]["ddp"]["compute_s"] == pytest.approx(0.5)
    assert doc["strategies"]["zero2"]["other_s"] == 0.0 and doc["strategies"]["zero2"]["compute_s"] < 0.5
