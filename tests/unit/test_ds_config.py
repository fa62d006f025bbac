import json

import pytest
import torch

from scale_ocr.errors import UserError
from scale_ocr.strategies.ds_config import load_ds_config, preset_path, resolve_ds_config

KW = dict(source="x.json", micro_batch=8, grad_accum=2, world_size=4, clip_grad=1.0, precision="fp32", lr=1e-3,
          weight_decay=0.01)


@pytest.mark.parametrize("name", ["zero1", "zero2", "zero3", "zero2_offload", "zero3_offload"])
def test_presets_resolve(name):
    cfg = resolve_ds_config(load_ds_config(preset_path(name)), **KW)
    assert cfg["train_micro_batch_size_per_gpu"] == 8
    assert cfg["gradient_accumulation_steps"] == 2
    assert cfg["train_batch_size"] == 64
    assert cfg["gradient_clipping"] == 1.0
    assert cfg["fp16"]["enabled"] is False and cfg["bf16"]["enabled"] is False
    assert cfg["zero_optimization"]["stage"] == int(name[4])
    assert "auto" not in json.dumps(cfg)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_half_precision_auto_follows_precision(precision):
    raw = {"fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"}}
    cfg = resolve_ds_config(raw, **{**KW, "precision": precision})
    assert cfg["fp16"]["enabled"] is (precision == "fp16") and cfg["bf16"]["enabled"] is (precision == "bf16")


def test_optimizer_section_is_filled():
    cfg = resolve_ds_config({"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}, **KW)
    assert cfg["optimizer"]["params"]["lr"] == 1e-3
    assert cfg["optimizer"]["params"]["weight_decay"] == 0.01


def test_contradicting_value_is_refused():
    with pytest.raises(UserError, match="contradicts --batch-size"):
        resolve_ds_config({"train_micro_batch_size_per_gpu": 16}, **KW)
    # equal explicit values are fine
    assert resolve_ds_config({"train_micro_batch_size_per_gpu": 8}, **KW)["train_batch_size"] == 64


def test_unfillable_auto_and_scheduler():
    with pytest.raises(UserError, match="zero_optimization.reduce_bucket_size"):
        resolve_ds_config({"zero_optimization": {"reduce_bucket_size": "auto"}}, **KW)
    with pytest.raises(UserError, match="scheduler"):
        resolve_ds_config({"scheduler": {"type": "WarmupLR"}}, **KW)


def test_malformed_json_names_line(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{\n  "train_batch_size": 8,\n}\n')
    with pytest.raises(UserError, match=r"bad.json is not valid JSON: .* line 3"):
        load_ds_config(bad)
    with pytest.raises(UserError, match="does not exist"):
        load_ds_config(tmp_path / "none.json")


@pytest.fixture
def restore_linear():
    """ZeRO-3's model construction replaces torch.nn.functional.linear for good (DeepSpeed says so); later tests in
    this process get torch's own back."""
    linear = torch.nn.functional.linear
    yield
    torch.nn.functional.linear = linear


def test_zero3_preset_keeps_a_bounded_part_of_the_model_gathered_from_the_second_step(restore_linear):
    """DeepSpeed's stage3_max_live_parameters default (1e9) lets the prefetch run to the end of the trace, and a
    parameter prefetched for its backward is not released after its forward: from step 2 the whole model stayed
    gathered from forward to backward. The preset bounds it (a real one-rank gloo group; 25M parameters)."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    from scale_ocr.config import ModelConfig, OptimConfig, StrategyConfig, TrainConfig
    from scale_ocr.distributed.process_group import destroy_distributed, init_distributed
    from scale_ocr.optim import build_optimizer_spec
    from scale_ocr.strategies import create_strategy
    from scale_ocr.tasks import create_task

    dist = init_distributed()
    try:
        strategy = create_strategy(StrategyConfig(strategy="zero3"), dist, TrainConfig(batch_size=1), OptimConfig())
        task = create_task(ModelConfig(arch="vitstr_small", model_width=512, model_depth=8))
        model, _ = strategy.setup(strategy.build_model(task.model_factory(), seed=0),
                                  build_optimizer_spec(OptimConfig()))
        params = [p for p in model.parameters() if not p.ds_persist]
        total = sum(p.ds_numel for p in params)
        gathered = []
        middle = model.module.blocks[4]
        middle.register_forward_hook(lambda *_: gathered.append(
            sum(p.ds_numel for p in params if p.ds_status != ZeroParamStatus.NOT_AVAILABLE)))
        for _ in range(3):
            strategy.backward(model(*task.dummy_inputs(1))["loss"])
            strategy.step()
        assert total > 2.4e7
        assert max(gathered[1:]) < 0.6 * total, (gathered, total)  # 1e7 elements and the Linear in use
        strategy.teardown()
    finally:
        destroy_distributed()


def test_deepspeed_ops_are_found_in_the_environment_unless_the_user_chose_a_folder(monkeypatch, tmp_path):
    """Every launch looks for DeepSpeed's compiled ops where `make install` built them (the venv's own
    torch_extensions), not in the home cache other venvs rebuild; a TORCH_EXTENSIONS_DIR you set wins."""
    import os
    import sys

    from scale_ocr.distributed import extensions

    monkeypatch.setattr(sys, "prefix", str(tmp_path))
    monkeypatch.setattr(sys, "base_prefix", "/usr")
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    extensions.use_environment_extensions()
    assert os.environ["TORCH_EXTENSIONS_DIR"] == str(tmp_path / "torch_extensions")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", "/mine")
    extensions.use_environment_extensions()
    assert os.environ["TORCH_EXTENSIONS_DIR"] == "/mine"
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    monkeypatch.setattr(sys, "base_prefix", str(tmp_path))  # no venv: torch's own default
    extensions.use_environment_extensions()
    assert "TORCH_EXTENSIONS_DIR" not in os.environ


def test_every_op_build_uses_the_environments_ninja(monkeypatch, tmp_path):
    """torch runs the first `ninja` on PATH; a system ninja and the venv's write incompatible build logs and
    each rebuilds every op the other built, so the environment's bin directory goes first."""
    import os
    import sysconfig

    from scale_ocr.distributed import extensions

    scripts = tmp_path / "bin"
    scripts.mkdir()
    (scripts / "ninja").write_text("")
    monkeypatch.setattr(sysconfig, "get_path", lambda name: str(scripts))
    monkeypatch.setenv("PATH", os.pathsep.join(["/usr/bin", str(scripts), "/bin"]))
    extensions.use_environment_extensions()
    extensions.use_environment_extensions()
    assert os.environ["PATH"].split(os.pathsep) == [str(scripts), "/usr/bin", "/bin"]


def test_zero3_overlaps_communication_on_gpus_only():
    raw = load_ds_config(preset_path("zero3"))
    assert raw["zero_optimization"]["overlap_comm"] == "auto"
    for device, overlap in (("cuda", True), ("cpu", False)):
        assert resolve_ds_config(raw, **KW, device_type=device)["zero_optimization"]["overlap_comm"] is overlap
    explicit = {"zero_optimization": {"stage": 3, "overlap_comm": True}}
    assert resolve_ds_config(explicit, **KW, device_type="cpu")["zero_optimization"]["overlap_comm"] is True
