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
    assert len(tried) <= 9  # a gallop up from a low start, then bisection: log2(64) + a few


def test_search_reports_nothing_when_even_the_smallest_does_not_fit_and_stops_on_a_crash():
    assert search_largest(lambda d: "oom", 1, 64, 8)[0] == 0
    # A crash is not an answer about memory: keep the largest known fit and stop searching.
    largest, tried = search_largest(lambda d: "ok" if d <= 4 else "failed", 1, 64, 2)
    assert largest == 4 and tried[-1] > 4 and len(tried) == 3


def test_prediction_fits_more_when_sharded_and_when_activations_are_recomputed():
    s = Search(arch="vitstr_tiny", width=256, world_size=2, budget_gb=2.0, batch_size=32, precision="fp32",
               max_depth=256)
    plain, recomputed = activation_line(s, False), activation_line(s, True)
    assert recomputed[1] < 0.5 * plain[1]  # per block, checkpointing keeps only each block's input
    depth = {(name, ac): predicted_largest(s, name, acts) for name in ("ddp", "fsdp")
             for ac, acts in ((False, plain), (True, recomputed))}
    assert 1 <= depth["ddp", False] < depth["fsdp", False] < depth["fsdp", True]
    assert depth["ddp", False] < depth["ddp", True]
