"""Hybrid sharding (hsdp, zero3_hpz): shard groups from the launch or --shard-size, refused when they cannot work,
and the memory model's share per rank. The 2-node x 2-rank runs are tests/distributed/test_hsdp.py."""

import pytest
import torch

from scale_ocr.config import OptimConfig, StrategyConfig, TrainConfig
from scale_ocr.distributed.process_group import DistInfo
from scale_ocr.errors import UserError
from scale_ocr.planning.estimate import ModelSize, estimate
from scale_ocr.strategies import check_launch, strategy_entry
from scale_ocr.strategies.ds_config import load_ds_config, preset_path, resolve_ds_config
from scale_ocr.train import main

KW = dict(source="x.json", micro_batch=4, grad_accum=1, world_size=4, clip_grad=1.0, precision="fp32", lr=1e-3,
          weight_decay=0.01)


def _strategy(name: str, world: int, local_world: int, shard_size: int | None = None):
    entry = strategy_entry(name)
    dist = DistInfo(0, world, 0, local_world, torch.device("cpu"), "gloo", "torchrun")
    return entry.cls(StrategyConfig(strategy=name, shard_size=shard_size), dist, TrainConfig(), OptimConfig(),
                     **entry.preset)


def test_shard_groups_default_to_the_ranks_per_node_and_follow_the_flag():
    assert _strategy("hsdp", 4, 2).shard == 2  # 2 nodes x 2: shard within a node
    assert _strategy("hsdp", 8, 4, shard_size=2).shard == 2
    hpz = _strategy("zero3_hpz", 4, 2).ds_config["zero_optimization"]
    assert hpz["zero_hpz_partition_size"] == 2 and hpz["stage"] == 3
    assert _strategy("zero3_hpz", 8, 8, shard_size=4).ds_config["zero_optimization"]["zero_hpz_partition_size"] == 4
    assert _strategy("hsdp", 4, 2).state_layout().shard_group == 2
    assert _strategy("zero3_hpz", 4, 2).state_layout().secondary_group == 2


def test_memory_model_shards_within_a_group_and_adds_hpz_secondary_copy():
    n = 1e8
    doc = estimate(ModelSize(int(n), 0), 8, "bf16", ["ddp", "fsdp", "hsdp", "zero3", "zero3_hpz"], ranks_per_node=2)
    rows = doc["strategies"]
    ddp = rows["ddp"]["model_state"]
    assert rows["fsdp"]["model_state"] == pytest.approx(ddp / 8)
    # hsdp: params, grads and optimizer state sharded over the 2 ranks of a node, replicated across the 4 nodes.
    assert rows["hsdp"]["model_state"] == pytest.approx(ddp / 2)
    assert rows["hsdp"]["ideal"] == pytest.approx(ddp / 2) and rows["hsdp"]["shard_group"] == 2
    # zero3_hpz: zero3's partitions over all 8 ranks, plus a 16-bit copy of the weights over the node's 2.
    assert rows["zero3_hpz"]["params"] == pytest.approx(rows["zero3"]["params"] + 2 * n / 2)
    assert rows["zero3_hpz"]["optimizer"] == rows["zero3"]["optimizer"]
    assert "hpZ" in rows["zero3_hpz"]["note"] and "groups of 2" in rows["hsdp"]["note"]


@pytest.mark.parametrize("world, local_world, flag, says", [
    (4, 2, 3, "shard groups of 3 ranks (--shard-size 3) do not divide the 4 ranks of this job; pass --shard-size "
              "with one of 1, 2, 4"),
    (6, 4, None, "shard groups of 4 ranks (the launcher's 4 ranks per node) do not divide the 6 ranks"),
])
def test_shard_size_that_does_not_divide_the_world_is_one_line(world, local_world, flag, says):
    with pytest.raises(UserError, match="--strategy hsdp: " + says.replace("(", r"\(").replace(")", r"\)")):
        _strategy("hsdp", world, local_world, flag)
    with pytest.raises(UserError, match="do not divide"):
        _strategy("zero3_hpz", world, local_world, flag)


def test_zero3_hpz_refuses_a_group_of_one_which_turns_hpz_off():
    with pytest.raises(UserError, match=r'"auto" is 1 \(one rank per node\), which turns ZeRO\+\+ hpZ off'):
        _strategy("zero3_hpz", 2, 1)
    with pytest.raises(UserError, match=r'"auto" is 1 \(--shard-size 1\)'):
        _strategy("zero3_hpz", 4, 2, shard_size=1)


def test_hpz_in_a_users_json():
    hpz = load_ds_config(preset_path("zero3_hpz"))
    with pytest.raises(UserError, match="--shard-size sets zero_optimization.zero_hpz_partition_size"):
        resolve_ds_config(load_ds_config(preset_path("zero3")), **KW, shard_size=2)
    with pytest.raises(UserError, match="contradicts --shard-size"):
        resolve_ds_config({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 4}}, **KW, shard_size=2)
    with pytest.raises(UserError, match="zero_hpz_partition_size 3 does not divide the 4 ranks"):
        resolve_ds_config({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 3}}, **KW)
    with pytest.raises(UserError, match="needs ZeRO stage 3"):
        resolve_ds_config({"zero_optimization": {"stage": 2, "zero_hpz_partition_size": "auto"}}, **KW, local_world=2)
    assert resolve_ds_config(hpz, **KW, local_world=2)["zero_optimization"]["zero_hpz_partition_size"] == 2


def test_check_launch_refuses_shard_size_where_it_means_nothing():
    zero3 = str(preset_path("zero3"))
    for name, ds_config in (("fsdp", None), ("ddp", None), ("zero3", None), ("deepspeed", zero3)):
        with pytest.raises(UserError, match=f"--shard-size sets the shard groups of hsdp, zero3_hpz, not of "
                                            f"--strategy {name}"):
            check_launch(StrategyConfig(strategy=name, shard_size=2, ds_config=ds_config), 4, "torchrun")
    check_launch(StrategyConfig(strategy="deepspeed", shard_size=2, ds_config=str(preset_path("zero3_hpz"))), 4,
                 "torchrun")  # a JSON of the user's with the key
    with pytest.raises(UserError, match="--strategy hsdp: shard groups of 3 ranks"):
        check_launch(StrategyConfig(strategy="hsdp", shard_size=3), 4, "torchrun")
    check_launch(StrategyConfig(strategy="zero3_hpz", shard_size=2), 4, "torchrun")


def test_train_cli_shard_size_errors_are_one_line(capsys, tmp_path):
    out = ["--output-dir", str(tmp_path / "run")]
    assert main(["--strategy", "fsdp", "--shard-size", "2", *out]) == 2
    assert main(["--strategy", "hsdp", "--shard-size", "0", *out]) == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("scale-ocr: error:")]
    assert len(lines) == 2 and "Traceback" not in err, err
    assert "not of --strategy fsdp" in lines[0] and "--shard-size 0: use 1 or more" in lines[1]
    assert not (tmp_path / "run").exists()  # refused before the run directory is claimed


def test_estimate_memory_takes_the_shard_size_and_lists_what_it_cannot_estimate(capsys):
    from scale_ocr.cli.estimate_memory import main as reported

    estimate_main = reported.__wrapped__

    assert estimate_main(["--params", "1e8", "--world-size", "8", "--shard-size", "2", "--precision", "bf16"]) == 0
    table = capsys.readouterr().out
    assert "hsdp: sharded within groups of 2 ranks, replicated across 4" in table and "zero3_hpz: " in table
    assert estimate_main(["--params", "1e8", "--world-size", "1"]) == 0  # one rank: no hpZ group to form
    assert "zero3_hpz: not estimated: " in capsys.readouterr().out
    with pytest.raises(UserError, match="--shard-size 3 does not divide --world-size 4"):
        estimate_main(["--params", "1e8", "--world-size", "4", "--shard-size", "3"])


def test_verify_refuses_nodes_that_do_not_split_the_world_evenly():
    from scale_ocr.cli.verify import main as verify_main

    with pytest.raises(UserError, match="--world-size 3 is not a multiple of --nodes 2"):
        verify_main(["--world-size", "3", "--nodes", "2", "--strategies", "ddp"])


def test_verify_fails_an_engine_whose_maths_differ_and_passes_float_noise():
    """What verify's table says of an engine: float noise from another reduction order passes; a run whose losses
    or weights moved as a doubled learning rate moves them (2-5% by step 4, tests/distributed/test_hsdp.py runs the
    engines for real) fails, and so does a run that logged fewer steps."""
    from scale_ocr.cli.verify import RunResult, compare, format_table

    weights = {"w": torch.linspace(-1, 1, 64), "b": torch.ones(8)}
    ref = RunResult([5.0, 4.8, 4.6, 4.4], [2.0, 1.6, 1.3, 1.1], weights)
    noise = RunResult([5.0, 4.8 * (1 + 1e-6), 4.6, 4.4 * (1 - 2e-5)], [2.0, 1.6 * (1 + 1e-4), 1.3, 1.1],
                      {k: v * (1 + 1e-6) for k, v in weights.items()})
    doubled = RunResult([5.0, 4.7, 4.45, 4.2], [2.0, 1.55, 1.25, 1.0], {k: v * 1.03 for k, v in weights.items()})
    short = RunResult(ref.losses[:3], ref.norms[:3], weights)
    rows = [compare("ddp", ref, ref), compare("fsdp", noise, ref), compare("zero2", doubled, ref),
            compare("zero3", short, ref)]
    assert [r.passed for r in rows] == [True, True, False, False], rows
    verdicts = [ln.split()[-1] for ln in format_table(rows, "ddp").splitlines()[2:6]]
    assert verdicts == ["reference", "pass", "FAIL", "FAIL"], format_table(rows, "ddp")
