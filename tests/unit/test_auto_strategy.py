"""--strategy auto: the fastest strategy predicted to fit, and one line saying why."""

import pytest

from scale_ocr.cli.args import parse_config
from scale_ocr.errors import UserError
from scale_ocr.planning.auto import GIB, MULTI_RANK_ORDER, choose_strategy, memory_needs

ARGS = ["vitstr_base", "--strategy", "auto", "-b", "2", "--precision", "bf16"]


@pytest.fixture(scope="module")
def needs():
    return memory_needs(parse_config(ARGS), world=2)[0]


def _choose(gb: float, world: int = 2):
    return choose_strategy(parse_config([*ARGS, "--device-memory-gb", str(gb)]), world, world)


def test_needs_follow_the_memory_model(needs):
    assert list(needs) == list(MULTI_RANK_ORDER)
    # Sharding parameters needs the least on the device; replication the most.
    assert needs["ddp"] > needs["zero2"] > needs["fsdp"]


def test_offload_frees_a_gpus_memory_but_not_a_cpu_ranks():
    """Offloaded state moves to host memory: off a GPU, but a CPU rank's device is the host, where it stays."""
    from scale_ocr.planning.auto import rank_need
    from scale_ocr.planning.estimate import ModelSize, estimate

    size = ModelSize(params=765_000_000, largest_layer=9_440_000)
    rows = estimate(size, 2, "bf16", ["zero3", "zero3_offload"])["strategies"]
    on_gpu = {name: rank_need(row, size.largest_layer, True) for name, row in rows.items()}
    on_cpu = {name: rank_need(row, size.largest_layer, False) for name, row in rows.items()}
    assert on_gpu["zero3_offload"] < on_gpu["zero3"] / 3
    assert on_cpu["zero3_offload"] >= on_cpu["zero3"]


def test_plenty_of_memory_picks_the_fastest(needs):
    name, why = _choose(64)
    assert name == "ddp" and why.startswith("ddp is the fastest that fits")


def test_tight_memory_picks_the_fastest_that_fits(needs):
    for i, slower in enumerate(MULTI_RANK_ORDER[1:], 1):
        faster = MULTI_RANK_ORDER[:i]
        if needs[slower] < min(needs[f] for f in faster):
            gb = (needs[slower] + min(needs[f] for f in faster)) / 2 / GIB
            name, why = _choose(gb)
            assert name == slower, (gb, name)
            assert f"{MULTI_RANK_ORDER[i - 1]} would need" in why
            return
    pytest.fail("no sharded strategy needs less than all faster ones")


def test_nothing_fits_is_one_clear_error(needs):
    with pytest.raises(UserError, match="nothing fits 0.5 GiB per rank .*lower the batch size or add ranks"):
        _choose(0.5)


def test_one_process_chooses_among_single_process_engines():
    name, why = _choose(64, world=1)
    assert name == "single"


@pytest.mark.slow
def test_auto_under_torchrun_trains_with_the_choice(tmp_path):
    import json

    from conftest import TINY, torchrun_train

    proc = torchrun_train(["--strategy", "auto", *TINY, "--wandb-mode", "disabled", "--output-dir", str(tmp_path)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("scale-ocr: --strategy auto -> ")]
    assert len(lines) == 1 and "ddp is the fastest that fits" in lines[0]  # printed once, by rank 0
    summary = json.loads((tmp_path / "metrics.json").read_text())
    assert summary["strategy"] == "ddp" and summary["world_size"] == 2
