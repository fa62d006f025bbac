"""The detection task end to end without training: batches, targets, evaluation and config checks."""

import pytest
import torch
from torch import nn

from scale_ocr.cli.args import parse_config
from scale_ocr.config import DataConfig, ModelConfig
from scale_ocr.distributed.process_group import DistInfo
from scale_ocr.errors import UserError
from scale_ocr.tasks import create_task
from scale_ocr.tasks.detection import TARGET_KEYS


class PerfectDetector(nn.Module):
    """Outputs the probability map the targets ask for: what a fully trained DBNet would."""

    def __init__(self, scale: float = 1.0) -> None:
        super().__init__()
        self.scale = scale

    def forward(self, images, prob_target=None, prob_mask=None, thresh_target=None, thresh_mask=None):
        logits = (prob_target[:, None] * 2 - 1) * 20 * self.scale
        return {"logits": logits, "losses": torch.zeros(images.shape[0])}


def _task_and_data(tmp_path, pages=6):
    # not square: catches H/W swaps
    task = create_task(ModelConfig(arch="db_mobilenet_v3_large", input_size=(256, 384)))
    cfg = DataConfig(train_samples=4, val_samples=pages)
    dist = DistInfo(0, 1, 0, 1, torch.device("cpu"), "gloo", "python")
    return task, task.build_data(cfg, batch_size=2, seed=0, dist=dist)


def test_batches_carry_images_and_db_targets(tmp_path):
    task, data = _task_and_data(tmp_path)
    batch = next(iter(data.train_loader))
    images, *maps = batch.inputs
    assert images.shape == (2, 3, 256, 384) and len(maps) == len(TARGET_KEYS)
    assert all(m.shape == (2, 256, 384) and m.dtype == torch.float32 for m in maps)
    assert maps[0].sum() > 0 and len(batch.polygons) == 2 and batch.valid.all()


def test_perfect_maps_score_near_one_and_empty_maps_zero(tmp_path):
    task, data = _task_and_data(tmp_path)
    autocast = torch.autocast("cpu", enabled=False)
    good = task.evaluate(PerfectDetector(), data.val_loader, torch.device("cpu"), lambda: autocast).metrics
    assert good["recall"] >= 0.9 and good["precision"] >= 0.9 and good["mean_iou"] > 0.6, good
    none = task.evaluate(PerfectDetector(scale=-1.0), data.val_loader, torch.device("cpu"), lambda: autocast).metrics
    assert none["recall"] == 0.0 and none["hmean"] == 0.0


@pytest.mark.parametrize("argv,message", [
    (["db_mobilenet_v3_large", "--input-size", "500x512"], "multiples of 32"),
    (["db_mobilenet_v3_large", "--data-cache", "words.pt"], "word crops"),
])
def test_detection_config_errors(tmp_path, argv, message):
    with pytest.raises(UserError, match=message):
        parse_config([*argv, "--output-dir", str(tmp_path / "run")])


def test_task_defaults_follow_the_architecture(tmp_path):
    det = parse_config(["db_mobilenet_v3_large", "--output-dir", str(tmp_path / "a")])
    reco = parse_config(["--output-dir", str(tmp_path / "b")])
    assert det.model.input_size == (512, 512) and det.data.train_samples == 2048
    assert reco.model.input_size == (32, 128) and reco.data.train_samples == 32768
