"""Training from several sources at stated weights (scale_ocr/data/mix.py, ``--train-path SOURCE=WEIGHT ...``)."""

from collections import Counter

import pytest
from conftest import make_folder

from scale_ocr.cli.make_shards import make_shards
from scale_ocr.config import DataConfig
from scale_ocr.data.loader import labels_digest
from scale_ocr.data.mix import open_train, parse
from scale_ocr.data.shard_reader import open_words
from scale_ocr.data.synthetic import SyntheticWords
from scale_ocr.errors import UserError
from scale_ocr.vocab import VOCABS, Vocab


def mixed(tmp_path, weights=(0.5, 0.3, 0.2)):
    """A 20-sample folder, 50 synthetic words and a 30-sample shard set (shards of 7) at ``weights``."""
    folder = make_folder(tmp_path / "real", {f"{i}.png": f"r{i}" for i in range(20)})
    if not (tmp_path / "set").exists():
        make_shards([make_folder(tmp_path / "src", {f"{i}.png": f"s{i}" for i in range(30)})], tmp_path / "set",
                    None, 7, seed=3, on_bad="error")
    sources = (f"{folder}={weights[0]}", f"synthetic={weights[1]}", f"{tmp_path / 'set'}={weights[2]}")
    cfg = DataConfig(train_path=sources, train_samples=50)
    vocab = Vocab(VOCABS["latin"])
    data, digest = open_train(cfg, lambda paths: open_words(paths, vocab, "error", None, (32, 128), True),
                              lambda: SyntheticWords(vocab.chars, 50, 3, 8, 0), labels_digest)
    return data, digest


def test_a_mix_draws_at_its_weights_and_resumes_at_any_world_size_where_every_source_stood(tmp_path, capsys):
    """Every stretch of the epoch holds each source at its weight within a sample; a source drawn more than it holds
    repeats only after a whole pass, one drawn less goes on next epoch where it stopped; a position saved at 2 ranks
    continues at 1 rank (another batch) with the same draw of every source; the draws are reported; a mix written
    wrong, or a position of another mix, is refused in one line."""
    data, digest = mixed(tmp_path)
    assert "training mix of 3 sources, 100 samples an epoch" in capsys.readouterr().out
    assert data.draws == [50, 30, 20] and len(digest) == 64
    two = data.position(seed=5, world=2, rank=0, workers=0, batch=3, main=True)
    whole = [two.item(p) for p in range(100)]
    for start in range(0, 90):
        window = Counter(s for s, _ in whole[start:start + 10])
        assert all(abs(window[s] - 10 * w) <= 1 for s, w in enumerate((0.5, 0.3, 0.2))), (start, window)
    folder = [i for s, i in whole if s == 0]
    assert sorted(folder[:20]) == sorted(folder[20:40]) == list(range(20)) != folder[:20]  # two whole passes, shuffled
    shards = [i for s, i in whole if s == 2]
    assert len(set(shards)) == 20 and all(isinstance(i, tuple) for i in shards)
    # 4 micro-batches at 2 ranks, then 1 rank at batch 5 takes the rest of the epoch: the same draws, in order
    state = two.state(0, 4)
    assert state["samples_in_epoch"] == 24 and state["kind"] == "mix"
    one = data.position(seed=5, world=1, rank=0, workers=0, batch=5, main=True)
    one.restore(0, 0, state)
    one.set_epoch(0)
    assert [i for batch in one for i in batch] == whole[24:99]  # 15 batches of 5; the last sample fills none
    assert "1 samples of the mix's epoch of 100 do not fill a global batch of 5" in capsys.readouterr().err
    one.set_epoch(1)  # the next epoch continues each source where the last stopped
    later = [one.item(p) for p in range(100)]
    assert sorted(folder[40:] + [i for s, i in later if s == 0][:10]) == list(range(20))  # pass 3 completed
    assert len(set(shards + [i for s, i in later if s == 2][:10])) == 30  # the set's first pass completed
    assert one.drawn({"epoch": 1, "samples_in_epoch": 10}) == {
        str(tmp_path / "real"): 55, "synthetic": 33, str(tmp_path / "set"): 22}
    other, _ = mixed(tmp_path, (0.4, 0.4, 0.2))
    with pytest.raises(UserError, match="belongs to another mix"):
        other.position(seed=5, world=1, rank=0, workers=0, batch=5, main=True).restore(0, 0, state)
    for items, words in ((["a/=0.5", "b/"], "every source takes its weight, SOURCE=WEIGHT"),
                         (["a/=0.5", "synthetic=-1"], "the weight '-1' is not a positive number"),
                         (["a/=0.5", "a/=0.2"], "the source 'a/' is given twice")):
        with pytest.raises(UserError, match=words):
            parse(items)
    assert parse(["a/", "b/"]) is None  # folders read together, as before


def test_a_run_stopped_mid_epoch_reports_the_draws_it_trained(tmp_path):
    """--max-steps ends a mix's run inside its second epoch: data_drawn counts the samples its steps drew (the first
    epoch whole, then the part of the second trained), not the epoch the loop would have gone on to."""
    import json

    from scale_ocr.train import main

    folder = make_folder(tmp_path / "real", {f"{i}.png": f"w{i}" for i in range(8)})
    run = tmp_path / "run"
    assert main(["crnn_mobilenet_v3_small", "--strategy", "single", "--threads", "1", "--train-path", f"{folder}=1",
                 "synthetic=1", "--train-samples", "8", "--max-chars", "4", "-b", "4", "--max-steps", "5", "--no-eval",
                 "--no-save-model", "--output-dir", str(run), "--wandb-mode", "disabled"]) == 0
    drawn = json.loads((run / "metrics.json").read_text())["data_drawn"]
    assert sum(drawn.values()) == 5 * 4 and drawn[str(folder)] == drawn["synthetic"] == 10, drawn
