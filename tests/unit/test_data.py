import numpy as np
import pytest
import torch

from scale_ocr.config import WORD_STYLES, DataConfig, ModelConfig
from scale_ocr.data import synthetic
from scale_ocr.data.loader import EvalShard
from scale_ocr.data.recognition import RecognitionFolder
from scale_ocr.data.synthetic import SyntheticWords, system_fonts
from scale_ocr.data.transforms import ResizePad, build_transform
from scale_ocr.distributed.process_group import DistInfo
from scale_ocr.tasks.recognition import Collate, RecognitionTask
from scale_ocr.vocab import Vocab, resolve_vocab


def _dist(rank=0, world=1):
    return DistInfo(rank, world, rank, world, torch.device("cpu"), "gloo", "python")


def test_system_fonts_found():
    # The machine has DejaVu; without it Pillow's bundled font is used (empty tuple).
    assert all(p.endswith(".ttf") for p in system_fonts())


@pytest.mark.parametrize("style", WORD_STYLES)
def test_synthetic_is_deterministic_per_seed_and_index(style):
    charset = resolve_vocab("latin") + " "  # the space: text parts its words with it
    a = SyntheticWords(charset, 50, 3, 8, seed=1, style=style)
    b = SyntheticWords(charset, 50, 3, 8, seed=1, style=style)
    c = SyntheticWords(charset, 50, 3, 8, seed=2, style=style)
    assert [a.label(i) for i in range(50)] == [b.label(i) for i in range(50)]
    assert [a.label(i) for i in range(50)] != [c.label(i) for i in range(50)]
    img_a, word_a = a.sample(7)
    img_b, word_b = b.sample(7)
    assert word_a == word_b and list(img_a.getdata()) == list(img_b.getdata())
    assert all(3 <= len(a.label(i)) <= 8 and set(a.label(i)) <= set(charset) for i in range(50))


def _ink_share(img) -> float:
    """Share of the crop's rows holding ink (pixels much darker than the crop's median)."""
    grey = np.asarray(img.convert("L"), dtype=np.float32)
    rows = np.nonzero((grey < np.median(grey) - 60).any(axis=1))[0]
    return (rows[-1] - rows[0] + 1) / grey.shape[0]


def test_page_words_are_cut_around_the_ink_as_a_detector_boxes_them():
    # "xxxx" has no ascender or descender: a line crop keeps the font's whole line around it, a page crop
    # (the detector's box, which hugs the ink) does not. The recognizer for page OCR must train on the latter.
    assert WORD_STYLES == tuple(synthetic.WORD_STYLES)
    fonts = system_fonts()
    shares = {style: np.mean([_ink_share(render("xxxx", np.random.default_rng(i), fonts)) for i in range(20)])
              for style, render in synthetic.WORD_STYLES.items()}
    assert shares["line"] < 0.5 and shares["page"] > 0.65, shares  # measured 0.41 and 0.75
    task = RecognitionTask(ModelConfig())
    data = task.build_data(DataConfig(train_samples=8, val_samples=4, synthetic_words="page"), 4, 0, _dist(0, 1))
    renders = {data.train_loader.dataset.dataset.render, data.val_loader.dataset.dataset.render}
    assert renders == {synthetic.render_page_word}


def test_resize_pad_keeps_aspect():
    from PIL import Image

    img = Image.new("RGB", (40, 20), (255, 255, 255))
    out = ResizePad((32, 128))(img)
    assert out.size == (128, 32)
    # 40x20 scaled by 1.6 -> 64x32; the right half is padding in the border colour.
    assert out.getpixel((100, 16)) == (255, 255, 255)


def test_transforms_output_shape():
    ds = SyntheticWords("abc", 4, 3, 4, seed=0, transform=build_transform((32, 128), train=True))
    x, _ = ds[0]
    assert x.shape == (3, 32, 128) and x.dtype == torch.float32


def test_synthetic_words_keep_rendered_words_bit_for_bit(monkeypatch):
    plain = build_transform((32, 128), train=True, augment=False)
    ds = SyntheticWords("abc", 3, 3, 4, seed=0, transform=plain)
    first = [ds[i] for i in range(3)]
    monkeypatch.setattr(ds, "render", lambda *a: (_ for _ in ()).throw(AssertionError("rendered again")))
    again = [ds[i] for i in range(3)]  # kept: no rendering, the same tensors
    fresh = [SyntheticWords("abc", 3, 3, 4, seed=0, transform=plain)[i] for i in range(3)]
    for (a, wa), (b, wb), (c, wc) in zip(first, again, fresh, strict=True):
        assert wa == wb == wc and torch.equal(a, b) and torch.equal(a, c) and a.dtype == torch.float32
    augmented = SyntheticWords("abc", 1, 3, 4, seed=0, transform=build_transform((32, 128), train=True))
    augmented[0]
    assert not augmented.kept  # random augmentation before resizing: nothing can be kept


def test_eval_shard_pads_evenly_and_masks():
    data = [(torch.zeros(1), str(i)) for i in range(5)]
    shards = [EvalShard(data, r, 2) for r in range(2)]
    assert [len(s) for s in shards] == [3, 3]
    seen = [s[i][1] for s in shards for i in range(3) if s[i][2]]
    assert sorted(seen, key=int) == [str(i) for i in range(5)]
    assert [s[i][2] for s in shards for i in range(3)].count(False) == 1


def test_collate_pads_targets():
    batch = Collate(Vocab("abc"))([(torch.zeros(3, 2, 2), "ab", True), (torch.zeros(3, 2, 2), "cab", False)])
    assert batch.targets.tolist() == [[1, 2, 0], [3, 1, 2]]
    assert batch.target_lengths.tolist() == [2, 3]
    assert batch.valid.tolist() == [True, False]


def test_folder_dataset(word_folder):
    ds = RecognitionFolder((str(word_folder),), Vocab(resolve_vocab("latin")))
    assert len(ds) == 8
    img, word = ds[0]
    assert word == "hello" and img.size[0] > 0


def test_train_sampler_gives_disjoint_shards():
    cfg = DataConfig(train_samples=64, val_samples=10)
    task = RecognitionTask(ModelConfig())
    shards = [task.build_data(cfg, 4, 0, _dist(r, 2)) for r in range(2)]
    idx = [set(s.position.sampler) for s in shards]
    assert not idx[0] & idx[1] and len(idx[0] | idx[1]) == 64
    shards[0].position.sampler.set_epoch(1)
    assert set(shards[0].position.sampler) != idx[0]  # a new permutation each epoch


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_cache_of_nan_or_inf_images_is_refused_when_it_loads(tmp_path, bad):
    """N01: a NaN (or inf) cache trained 5 NaN steps and ended "training diverged ... lower --lr": refused at load,
    naming the cache and its first bad image."""
    from scale_ocr.data.cache import TensorWords, build_cache
    from scale_ocr.errors import UserError

    path = build_cache(tmp_path / "c.pt", 4, (32, 64), "abc")
    data = torch.load(path, weights_only=True)
    data["images"][2, 0, 5, 5] = bad
    torch.save(data, path)
    with pytest.raises(UserError, match=r"--data-cache .*c\.pt holds 1 of 4 images with NaN or inf pixels \(the first: "
                                        r"image 2\).*rebuild the cache"):
        TensorWords(path, Vocab("abc"), (32, 64))
    torch.save({**data, "images": [1, 2]}, path)  # not a tensor: one line, not an AttributeError
    with pytest.raises(UserError, match="is not a scale-ocr image cache"):
        TensorWords(path, Vocab("abc"), (32, 64))


def test_the_cache_builder_draws_trainings_words_into_a_new_file_only(tmp_path, capsys):
    """`scale-ocr make-cache` takes training's word flags (its fonts said in one line), writes a cache a run
    loads, and refuses in one line an existing file (left as it was) or a malformed size."""
    from scale_ocr.cli.make_cache import main
    from scale_ocr.data.cache import TensorWords

    path = tmp_path / "words.pt"
    assert main([str(path), "-n", "4", "--input-size", "32x64", "--vocab", "digits", "--fonts", "classic",
                 "--synthetic-words", "page", "--min-chars", "3", "--max-chars", "9", "--seed", "3"]) == 0
    assert "synthetic fonts (classic)" in capsys.readouterr().out
    words = TensorWords(path, Vocab("0123456789"), (32, 64))
    assert len(words) == 4 and all(3 <= len(w) <= 9 and set(w) <= set("0123456789") for w in words.labels)
    before = path.read_bytes()
    assert main([str(path), "-n", "2"]) == 2
    assert "already exists; make-cache never writes over a file" in capsys.readouterr().err
    assert path.read_bytes() == before
    for flags in (["--input-size", "32x"], ["--seed", "-1"]):  # a traceback each, before
        try:
            code = main([str(tmp_path / "other.pt"), *flags])
        except SystemExit as refused:  # argparse's own line
            code = refused.code
        assert code == 2 and not (tmp_path / "other.pt").exists()
