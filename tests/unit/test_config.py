import dataclasses
import json

import pytest

from scale_ocr.cli.args import parse_config
from scale_ocr.config import RunConfig
from scale_ocr.errors import UserError


def test_defaults_are_consistent():
    cfg = parse_config([])
    assert cfg.model.arch == "crnn_mobilenet_v3_small"
    assert cfg.model.input_size == (32, 128)
    assert cfg.strategy.strategy == "ddp"
    assert isinstance(cfg, RunConfig)


def test_doctr_spellings_are_aliases():
    cfg = parse_config(["crnn_vgg16_bn", "--train_path", "a", "b", "--val_path", "v", "--output_dir", "out",
                        "--amp", "--batch_size", "7"])
    assert cfg.model.arch == "crnn_vgg16_bn"
    assert cfg.data.train_path == ("a", "b") and cfg.data.val_path == ("v",)
    assert cfg.output.output_dir == "out"
    assert cfg.train.precision == "bf16"
    assert cfg.train.batch_size == 7


def test_deepspeed_launcher_local_rank_is_accepted():
    assert parse_config(["--local_rank=1"]).strategy.strategy == "ddp"
    assert parse_config(["--local-rank", "0"]).strategy.strategy == "ddp"


@pytest.mark.parametrize("text,size", [("32x128", (32, 128)), ("48", (48, 192)), ("64,256", (64, 256))])
def test_input_size_forms(text, size):
    cfg = parse_config(["--input-size", text, "--max-chars", "8"])
    assert cfg.model.input_size == size


@pytest.mark.parametrize("text", ["32x", "3xx", "x128", "32x128x3"])
def test_a_malformed_input_size_is_refused_not_guessed(text):
    """"32x" once read as 32x128 and "3xx" as 3x12: an empty part is a mistake, said in one line."""
    from scale_ocr.errors import UserError

    with pytest.raises(UserError, match=f"--input-size: '{text}' is not HxW"):
        parse_config(["--input-size", text])


def test_config_file_then_flags(tmp_path):
    f = tmp_path / "run.json"
    f.write_text(json.dumps({"train": {"batch_size": 3, "epochs": 9}, "lr": 0.5}))
    cfg = parse_config(["--config", str(f), "--epochs", "2"])
    assert cfg.train.batch_size == 3  # from the file
    assert cfg.optim.lr == 0.5  # flat keys work too
    assert cfg.train.epochs == 2  # the flag wins


def test_config_file_unknown_key(tmp_path):
    f = tmp_path / "run.json"
    f.write_text(json.dumps({"batchsize": 3}))
    with pytest.raises(UserError, match="unknown keys"):
        parse_config(["--config", str(f)])


@pytest.mark.parametrize("argv,match", [
    (["--batch-size", "0"], "batch-size"),
    (["--min-chars", "5", "--max-chars", "3"], "min-chars"),
    (["--max-chars", "40"], "CTC frames"),
    (["--lr", "-1"], "learning rate"),
    (["--grad-accum", "0"], "grad-accum"),
])
def test_cross_field_checks(argv, match):
    with pytest.raises(UserError, match=match):
        parse_config(argv)


def test_config_is_frozen():
    cfg = parse_config([])
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.train.batch_size = 3  # type: ignore[misc]


def test_resolved_config_round_trips_to_json():
    cfg = parse_config(["--train-path", "x"])
    assert json.loads(json.dumps(cfg.to_dict()))["data"]["train_path"] == ["x"]
