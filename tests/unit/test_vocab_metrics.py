import pytest

from scale_ocr.errors import UserError
from scale_ocr.tasks.text_metrics import TextMetric, edit_distance
from scale_ocr.vocab import VOCABS, Vocab, resolve_vocab


def test_named_and_literal_vocabs(tmp_path):
    assert resolve_vocab("digits") == "0123456789"
    assert resolve_vocab("abca") == "abc"  # literal characters, duplicates dropped
    f = tmp_path / "v.txt"
    f.write_text("xyz\n", encoding="utf-8")
    assert resolve_vocab("latin", str(f)) == "xyz"
    with pytest.raises(UserError, match="does not exist"):
        resolve_vocab("latin", str(tmp_path / "missing.txt"))


def test_default_vocab_covers_letters_digits_punctuation():
    latin = VOCABS["latin"]
    assert all(c in latin for c in "aZ09.,;:!?-'\"()")


def test_encode_decode_round_trip():
    v = Vocab("abc")
    assert v.num_classes == 4
    assert v.encode("cab").tolist() == [3, 1, 2]
    assert v.decode([3, 0, 1, 2]) == "cab"
    assert v.unknown_chars("abxyx") == "xy"


@pytest.mark.parametrize("a,b,d", [("", "", 0), ("abc", "abc", 0), ("abc", "abd", 1), ("kitten", "sitting", 3),
                                   ("", "abc", 3), ("abc", "", 3)])
def test_edit_distance(a, b, d):
    assert edit_distance(a, b) == d


def test_text_metric_rates():
    m = TextMetric()
    m.update(["hello", "World", "ab"], ["hello", "world", "abcd"])
    r = TextMetric.rates(m.sums())
    assert r["exact_match"] == pytest.approx(1 / 3)
    assert r["ci_match"] == pytest.approx(2 / 3)
    assert r["cer"] == pytest.approx((0 + 1 + 2) / (5 + 5 + 4))
