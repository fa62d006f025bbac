"""The largest-model search: its bisection, and the memory model's prediction it starts from."""

import pytest

from benchmarks.max_model import Search, activation_line, predicted_largest, search_largest


@pytest.mark.parametrize("start", [1, 5, 13, 14, 40, 64])
def test_search_finds_the_largest_fit_from_any_start_in_few_probes(start):
    tried = []

    def fits(depth):
        tried.append(depth)
        return "ok" if depth <= 13 else "oom"

    largest, probes = search_largest(fits, 1, 64, start)
    assert largest == 13 and probes == tried
    assert len(tried) <= 10  # steps that double away from a bad start, then bisection: log2(64) + a few


def test_search_reports_nothing_when_even_the_smallest_does_not_fit_and_stops_on_a_crash():
    assert search_largest(lambda d: "oom", 1, 64, 8)[0] == 0
    # A crash is not an answer about memory: keep the largest known fit and stop searching.
    largest, tried = search_largest(lambda d: "ok" if d <= 4 else "failed", 1, 64, 2)
    assert largest == 4 and tried == [2, 3, 4, 6]


@pytest.mark.parametrize("start", [26, 28, 30, 32, 34])
def test_a_prediction_within_15_percent_costs_at_most_five_probes(start):
    largest, tried = search_largest(lambda d: "ok" if d <= 30 else "oom", 1, 128, start)
    assert largest == 30 and len(tried) <= 5, tried


def test_prediction_fits_more_when_sharded_and_when_activations_are_recomputed():
    s = Search(arch="vitstr_tiny", width=256, world_size=2, budget_gb=2.0, batch_size=32, precision="bf16",
               max_depth=256)
    plain, recomputed = activation_line(s, False), activation_line(s, True)
    for casting in (True, False):
        assert recomputed[casting][1] < 0.5 * plain[casting][1]  # per block, checkpointing keeps each block's input
    # Autocast over fp32 weights saves a 16-bit copy of every weight it multiplies (2 bytes per block parameter),
    # and an fp32 position embedding keeps the residual stream in fp32; 16-bit weights do neither.
    per_block = 12 * 256 * 256 + 13 * 256
    assert plain[True][1] - plain[False][1] >= 2 * per_block
    depth = {(name, ac): predicted_largest(s, name, acts) for name in ("ddp", "fsdp", "zero3")
             for ac, acts in ((False, plain), (True, recomputed))}
    assert 1 <= depth["ddp", False] < depth["fsdp", False] < depth["fsdp", True]
    assert depth["ddp", False] < depth["ddp", True] and depth["zero3", False] < depth["zero3", True]


def test_report_lists_every_probe_with_its_losses_and_peaks(tmp_path):
    import json
    from dataclasses import asdict

    from benchmarks.max_model import Probe, write_report

    s = Search(arch="vitstr_tiny", width=64, strategies=("ddp", "fsdp"), budget_gb=9.0, depths=(15,),
               checkpointing=(False,), samples=4)
    (tmp_path / "search.json").write_text(json.dumps({"search": asdict(s), "hardware": {"cpu": "c", "cores": 2},
                                                      "versions": {"git": "abc"}}))
    predicted = {"need": 11 * 2**30, "model_state": 1, "params": 1, "largest_depth": 9}
    probes = [Probe("ddp", False, 15, 10**6, "oom", "out of memory on rank 1", {"predicted": predicted}),
              Probe("fsdp", False, 15, 10**6, "ok", None, {
                  "predicted": predicted, "samples_per_sec": 0.05, "peak_memory_bytes": 7.5 * 2**30,
                  "peak_mean_bytes": 7.25 * 2**30, "losses": [16.5, 12.25]})]
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(asdict(p)) + "\n" for p in probes))
    report = write_report(tmp_path).read_text()
    assert "--depths 15" in report and "--samples 4" in report
    assert "| ddp | off | 15 | 1M | oom | 11.00 GiB | - | - | out of memory on rank 1 |" in report
    assert "| fsdp | off | 15 | 1M | ok | 11.00 GiB | 7.50 (7.25) GiB | 0.05 | 16.500 → 12.250 |" in report
    assert (tmp_path / "fits.png").stat().st_size > 0
    # --repredict: the same probes against this checkout's memory model, which the report then names
    from benchmarks.max_model import repredict

    doc = json.loads(repredict(tmp_path).read_text())
    report = write_report(tmp_path).read_text()
    assert f"Predictions: the memory model at git {doc['git']}" in report
    need = doc["need"]["fsdp@15"] / 2**30
    assert 0 < need < 11 and f"| fsdp | off | 15 | 1M | ok | {need:.2f} GiB |" in report
    assert f"| {doc['largest']['fsdp']} |" in report


def test_depths_must_be_whole_numbers(tmp_path):
    from benchmarks.max_model import main
    from scale_ocr.errors import UserError

    with pytest.raises(UserError, match="--depths"):
        main(["--depths", "12,x", "--out", str(tmp_path)])


def test_update_searches_a_part_again_and_keeps_the_other_probes(tmp_path, monkeypatch):
    import dataclasses
    import json
    import shutil

    import benchmarks.max_model as mm
    from benchmarks.harness import work_dir

    s = Search(arch="vitstr_tiny", width=64, strategies=("ddp", "zero3"), budget_gb=9.0, depths=(15,),
               checkpointing=(False,), samples=4)
    fits = {"ddp": "ok", "zero3": "oom"}
    monkeypatch.setattr(mm, "run_probe", lambda s, strategy, ckpt, depth, *_: mm.Probe(
        strategy, ckpt, depth, 10**6, fits[strategy], None, {}))
    try:
        mm.run_search(s, tmp_path)
        fits["zero3"] = "ok"  # a fix that concerns zero3 only
        mm.run_search(dataclasses.replace(s, strategies=("zero3",)), tmp_path, update=True)
    finally:
        shutil.rmtree(work_dir(tmp_path), ignore_errors=True)
    probes = [json.loads(ln) for ln in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [(p["strategy"], p["status"]) for p in probes] == [("ddp", "ok"), ("zero3", "ok")]
    header = json.loads((tmp_path / "search.json").read_text())
    assert header["search"]["strategies"] == ["ddp", "zero3"] and header["updates"][0]["strategies"] == ["zero3"]
    assert f"Re-measured at git {header['updates'][0]['git']}" in mm.write_report(tmp_path).read_text()
