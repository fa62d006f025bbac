"""The time model: bytes each engine moves per step, the step's parts, the scaling curve, and its flags refused."""

import contextlib
import io
import json

import pytest

from scale_ocr.cli.estimate_memory import main as estimate_main
from scale_ocr.strategies import time_model as tm
from scale_ocr.strategies.estimate import build_strategy

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
    (["--device", "h100", "--mfu", "0"], "--mfu 0.0: give a fraction in (0, 1]"),
    (["--device", "h100", "--per-node", "0"], "--per-node must be at least 1"),
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
