import numpy as np
import pytest
import torch

from scale_ocr.errors import UserError
from scale_ocr.models import create_model, list_models, model_entry
from scale_ocr.models.detection import build_targets, db_loss
from scale_ocr.models.detection.dbnet import DBNet

DB_MODELS = list_models("db_*")


@pytest.fixture(autouse=True)
def _one_thread():
    # Convolutions this small gain nothing from threads, and on a busy 2-core box OpenMP's spinning
    # threads made a 30-step toy training 40x slower (0.5 s -> 20 s).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

# A 100x40 box: A = 4000, L = 280, so D = A (1 - 0.4^2) / L = 12 pixels.
BOX = np.array([[[50, 50], [150, 50], [150, 90], [50, 90]]], dtype=np.float64)


def _targets(polygons, h=64, w=64, batch=1) -> dict[str, torch.Tensor]:
    maps = build_targets(np.asarray(polygons, dtype=np.float64), h, w)
    return {k: torch.from_numpy(v)[None].repeat(batch, 1, 1) for k, v in maps.items()}


def _extent(mask: np.ndarray) -> tuple[int, int, int, int]:
    ys, xs = np.nonzero(mask)
    return xs.min(), ys.min(), xs.max(), ys.max()


def test_detection_models_are_registered():
    assert DB_MODELS == ["db_mobilenet_v3_large", "db_resnet50"]
    assert all(model_entry(name).task == "detection" for name in DB_MODELS)


@pytest.mark.parametrize("name", DB_MODELS)
def test_dbnet_forward_backward(name):
    torch.manual_seed(0)
    model = create_model(name, input_size=(64, 64), num_classes=11)  # a generic caller's extra kwargs are ignored
    targets = _targets([[[10, 20], [50, 20], [50, 36], [10, 36]]], batch=2)
    out = model(torch.randn(2, 3, 64, 64), **targets)
    assert out["logits"].shape == (2, 1, 64, 64)
    assert out["losses"].shape == (2,) and out["loss"].ndim == 0 and torch.isfinite(out["loss"])
    out["loss"].backward()
    # Every parameter takes part in the loss: DDP needs no find_unused_parameters.
    assert all(p.grad is not None for p in model.parameters())


def test_eval_forward_without_targets_gives_logits_only():
    model = create_model("db_mobilenet_v3_large", input_size=(64, 64)).eval()
    with torch.no_grad():
        out = model(torch.randn(1, 3, 64, 96))
    assert set(out) == {"logits"} and out["logits"].shape == (1, 1, 64, 96)


def test_sharding_units_cover_all_parameters():
    model = create_model("db_mobilenet_v3_large", input_size=(64, 64))
    covered = [id(p) for unit in model.sharding_units() for p in unit.parameters()]
    assert sorted(covered) == sorted(id(p) for p in model.parameters())  # each exactly once


@pytest.mark.parametrize("size", [(500, 512), (512, 500), (0, 512)])
def test_input_size_not_multiple_of_32_is_a_user_error(size):
    with pytest.raises(UserError, match="multiples of 32"):
        create_model("db_mobilenet_v3_large", input_size=size)


def test_forward_rejects_non_multiple_of_32_images():
    model = create_model("db_mobilenet_v3_large", input_size=(64, 64))
    with pytest.raises(UserError, match="70x64"):
        model(torch.randn(1, 3, 70, 64))


def test_targets_of_a_rectangle():
    t = build_targets(BOX, 128, 200)
    # Shrunk by D = 12 on every side: (62, 62)-(138, 78); dilated by 12: (38, 38)-(162, 102).
    assert np.allclose(_extent(t["prob_target"] > 0), (62, 62, 138, 78), atol=1)
    assert np.allclose(_extent(t["thresh_mask"] > 0), (38, 38, 162, 102), atol=1)
    assert t["prob_target"][62:79, 62:139].all() and t["prob_target"].sum() == 17 * 77
    assert t["prob_mask"].min() == 1
    tt = t["thresh_target"]
    assert tt.min() >= 0.3 and tt.max() <= 0.7
    assert tt[70, 50] == pytest.approx(0.7)  # on the box's edge
    assert tt[70, 45] == pytest.approx(0.3 + 0.4 * (1 - 5 / 12))  # 5 px outside the edge
    assert tt[70, 100] == pytest.approx(0.3)  # more than D inside: no border


def test_tiny_polygon_is_ignored_not_background():
    t = build_targets(np.array([[[10, 10], [40, 10], [40, 12], [10, 12]]]), 64, 64)
    assert t["prob_target"].max() == 0 and t["thresh_mask"].max() == 0
    assert t["prob_mask"][11, 20] == 0 and t["prob_mask"][30, 30] == 1


def test_thin_rotated_polygon_is_ignored():
    # 2 px thick at 45 degrees: its axis-aligned box is 40x40, its min-area rectangle is thin.
    line = np.array([[[10, 12], [12, 10], [50, 48], [48, 50]]], dtype=np.float64)
    t = build_targets(line, 64, 64)
    assert t["prob_target"].max() == 0 and t["prob_mask"][30, 30] == 0


def test_polygons_are_clipped_to_the_image():
    t = build_targets(np.array([[[-20, 10], [40, 10], [40, 30], [-20, 30]]]), 64, 64)
    assert all(v.shape == (64, 64) for v in t.values())
    x0, _, x1, _ = _extent(t["prob_target"] > 0)
    assert x0 > 0 and x1 < 40  # shrunk from the clipped box (0..40), not the original (-20..40)


@pytest.mark.parametrize("empty", [np.zeros((0, 4, 2)), []])
def test_page_without_words(empty):
    t = build_targets(empty, 32, 64)
    assert t["prob_target"].max() == 0 and t["thresh_mask"].max() == 0
    assert t["prob_mask"].min() == 1 and np.all(t["thresh_target"] == np.float32(0.3))


def test_db_loss_is_finite_on_an_empty_page():
    logits = torch.randn(2, 1, 32, 32, requires_grad=True)
    thresh = torch.rand(2, 1, 32, 32, requires_grad=True)
    loss = db_loss(logits, thresh, **_targets([], 32, 32, batch=2))
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logits.grad).all() and torch.isfinite(thresh.grad).all()


def test_db_loss_per_sample_and_fp32_under_autocast():
    targets = _targets(BOX / 4, 32, 48, batch=3)
    logits = torch.randn(3, 1, 32, 48, dtype=torch.bfloat16)
    thresh = torch.rand(3, 1, 32, 48, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        per = db_loss(logits, thresh, **targets, reduction="none")
        mean = db_loss(logits, thresh, **targets)
    assert per.shape == (3,) and per.dtype == torch.float32 and torch.isfinite(per).all()
    assert mean.item() == pytest.approx(per.mean().item())


def test_hard_negative_mining_keeps_three_negatives_per_positive():
    target = torch.zeros(1, 4, 4)
    target[0, 0, 0] = 1
    ones = torch.ones(1, 4, 4)
    # The positive has logit 0; the negatives have logits 0..14, so the 3 hardest are 12, 13, 14.
    logits = torch.cat([torch.zeros(1), torch.arange(15.0)]).reshape(1, 1, 4, 4)
    loss = db_loss(logits, torch.zeros_like(logits), target, ones, ones, ones, alpha=0, beta=0)
    bce = torch.nn.functional.softplus  # BCE of a negative with logit x; the positive's is softplus(-0)
    expected = (bce(torch.tensor(0.0)) + bce(torch.tensor([12.0, 13.0, 14.0])).sum()) / 4
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)


def _tiny_dbnet() -> DBNet:
    """DBNet's neck, heads and loss on a 4-stage toy backbone (strides 4, 8, 16, 32): fast enough to train."""
    def down(c_in, c_out, stride=2):
        return torch.nn.Sequential(torch.nn.Conv2d(c_in, c_out, 3, stride, 1), torch.nn.BatchNorm2d(c_out),
                                   torch.nn.ReLU())
    stages = [torch.nn.Sequential(down(3, 8), down(8, 8)), down(8, 8), down(8, 16), down(16, 16)]
    return DBNet(stages, (8, 8, 16, 16), fpn_channels=16)


def test_tiny_dbnet_overfits_one_page():
    torch.manual_seed(0)
    model = _tiny_dbnet()
    images = torch.randn(2, 3, 64, 64)
    targets = _targets([[[8, 8], [56, 8], [56, 28], [8, 28]], [[8, 36], [40, 36], [40, 56], [8, 56]]], batch=2)
    opt = torch.optim.Adam(model.parameters(), lr=3e-2)
    losses = []
    for _ in range(30):
        loss = model(images, **targets)["loss"]
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.6 * losses[0], losses  # about 0.45 with this seed
