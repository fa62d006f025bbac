"""A DeepSpeed JSON's keys are checked against the installed DeepSpeed's own config classes: an unknown or removed
``zero_optimization`` key is one line before anything starts, an unknown top-level key a warning (DeepSpeed ignores
it), each naming the closest known key; every preset passes without either."""

from __future__ import annotations

import inspect
import json
import re

import pytest

pytest.importorskip("deepspeed")

import deepspeed  # noqa: E402
from deepspeed.runtime import config as ds_config_module  # noqa: E402

from scale_ocr.errors import UserError  # noqa: E402
from scale_ocr.strategies import ds_keys  # noqa: E402
from scale_ocr.strategies.ds_config import load_ds_config, preset_path, resolve_ds_config  # noqa: E402
from scale_ocr.train import main as train_main  # noqa: E402

KW = dict(micro_batch=8, grad_accum=2, world_size=4, clip_grad=1.0, precision="fp32", lr=1e-3, weight_decay=0.01,
          nvme_default="/tmp/nvme")
PRESETS = ["zero1", "zero2", "zero3", "zero2_offload", "zero3_offload", "zero3_nvme"]


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_passes_without_a_warning(name, capsys):
    resolve_ds_config(load_ds_config(preset_path(name)), source=name, **KW)
    assert capsys.readouterr().err == ""


def test_unknown_top_level_key_is_a_warning_naming_the_closest_known_key(capsys):
    cfg = resolve_ds_config({"gradient_acumulation_steps": 4}, source="my.json", **KW)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("scale-ocr: warning: my.json: DeepSpeed ignores the unknown "
                                                   "top-level key 'gradient_acumulation_steps' (did you mean "
                                                   "'gradient_accumulation_steps'?)"), err
    assert cfg["gradient_accumulation_steps"] == 2  # the flag's, as DeepSpeed would run it


def test_unknown_zero_optimization_key_is_one_line_before_the_run_starts(tmp_path, capsys):
    bad = tmp_path / "ds.json"
    bad.write_text(json.dumps({"zero_optimization": {"stage": 2, "overlap_com": True}}))
    code = train_main(["--strategy", "deepspeed", "--ds-config", str(bad), "--max-steps", "1", "--train-samples", "8",
                       "--val-samples", "4", "-b", "4", "--wandb-mode", "disabled", "--output-dir",
                       str(tmp_path / "run")])
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("scale-ocr: error:")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0] == (f"scale-ocr: error: {bad}: unknown key 'zero_optimization.overlap_com'; did you mean "
                        "'zero_optimization.overlap_comm'? (DeepSpeed refuses unknown zero_optimization keys)")


@pytest.mark.parametrize(("raw", "says"), [
    ({"elasticity": {}}, "'elasticity': Elastic training has been removed"),
    ({"zero_optimization": {"mics_shard_size": 2}}, "'zero_optimization.mics_shard_size': MiCS ZeRO-3 sharding"),
])
def test_keys_deepspeed_removed_are_refused_with_its_reason(raw, says):
    with pytest.raises(UserError, match=re.escape(f"my.json: {says}")):
        resolve_ds_config(raw, source="my.json", **KW)


def test_zero_keys_are_deepspeeds_fields_and_aliases():
    fields = deepspeed.runtime.zero.config.DeepSpeedZeroConfig.model_fields
    assert {"stage", "overlap_comm", "stage3_prefetch_bucket_size", "prefetch_bucket_size"} <= ds_keys.zero_keys()
    assert len(ds_keys.zero_keys()) == len(fields) + sum(1 for f in fields.values() if f.alias)


def test_top_level_keys_follow_what_deepspeed_reads(monkeypatch):
    """The known keys are recorded from DeepSpeedConfig's parse, so a release that reads another key (here: a
    getter that reads a renamed key) changes them without anyone editing a list."""
    known = ds_keys.top_level_keys()
    assert {"train_batch_size", "zero_optimization", "bf16", "optimizer", "aio", "activation_checkpointing"} <= known
    monkeypatch.setattr(ds_config_module, "get_steps_per_print", lambda d: d.get("steps_per_print_v2", 10))
    ds_keys.top_level_keys.cache_clear()
    try:
        changed = ds_keys.top_level_keys()
    finally:
        ds_keys.top_level_keys.cache_clear()
    assert changed ^ known == {"steps_per_print", "steps_per_print_v2"}


def test_keys_only_initialize_reads_are_listed():
    """deepspeed.initialize reads a few keys from the config itself; the hand list (READ_BY_INITIALIZE, read from
    DeepSpeed 0.19.8) must be exactly those the recording cannot see, so this fails when DeepSpeed gains or \
drops one."""
    source = inspect.getsource(deepspeed.initialize)
    read = set(re.findall(r"""config\[["'](\w+)["']\]|["'](\w+)["'] in config\b|config\.get\(["'](\w+)["']""",
                          source))
    read = {name for match in read for name in match if name}
    recorded = ds_keys.top_level_keys() - set(ds_keys.READ_BY_INITIALIZE)
    assert read - recorded == set(ds_keys.READ_BY_INITIALIZE), read
