"""docTR's models in the registry (``doctr:``), and weights in and out in docTR's layout."""

from __future__ import annotations

import sys

import doctr.models as doctr_models
import numpy as np
import pytest
import torch
from doctr.datasets import VOCABS

from scale_ocr.checkpoint.weights_io import doctr_state_dict, load_initial_weights
from scale_ocr.config import ModelConfig
from scale_ocr.errors import UserError
from scale_ocr.models import create_model, model_entry
from scale_ocr.tasks import create_task, task_from_identity
from scale_ocr.tasks.recognition import Collate


@pytest.mark.parametrize("arch", ["crnn_mobilenet_v3_small", "parseq"])
def test_a_doctr_model_is_doctrs_class_with_doctrs_loss_vocabulary_and_decoding(arch):
    task = create_task(ModelConfig(arch=f"doctr:{arch}"))
    assert task.name == "doctr_recognition" and task.vocab.chars == VOCABS["french"]  # docTR's default vocabulary
    torch.manual_seed(0)
    model = task.build_model()
    theirs = getattr(doctr_models, arch)(pretrained=False, pretrained_backbone=False)
    theirs.load_state_dict(model.state_dict(), strict=True)  # docTR's state dict, key for key
    assert isinstance(model, type(theirs))
    words = ["Été", "42€", "docTR"]
    batch = Collate(task.vocab)([(torch.rand(3, 32, 128), w, True) for w in words])
    model.eval(), theirs.eval()
    with torch.no_grad():
        ours = model(*batch.inputs)
        ref = theirs(batch.images, target=words, return_model_output=True, return_preds=True)
        bare = model(batch.images)
    assert ours["loss"] == pytest.approx(float(ref["loss"]), rel=1e-6)  # docTR's own loss on the same words
    assert [w for w, _ in task.decode(ours["logits"])] == [w for w, _ in ref["preds"]]
    assert "loss" not in bare and bare["logits"].shape[0] == 3
    # --vocab names are docTR's for docTR's models (its "latin" differs from scale_ocr's)
    assert create_task(ModelConfig(arch=f"doctr:{arch}", vocab="latin")).vocab.chars == VOCABS["latin"]
    again = task_from_identity(task.identity())
    assert again.vocab.chars == task.vocab.chars and again.name == task.name


def test_scale_ocrs_crnn_is_doctrs_crnn_in_another_layout(tmp_path):
    task = create_task(ModelConfig(arch="crnn_mobilenet_v3_small", vocab=VOCABS["french"]))
    torch.manual_seed(0)
    ours = task.build_model().eval()
    arch, state = doctr_state_dict(ours, task.arch)
    theirs = getattr(doctr_models, arch)(pretrained=False, pretrained_backbone=False).eval()
    theirs.load_state_dict(state, strict=True)
    x = torch.randn(2, 3, 32, 128)
    with torch.no_grad():
        a, b = ours(x)["logits"], theirs(x, return_model_output=True)["out_map"]
    torch.testing.assert_close(torch.cat([a[..., 1:], a[..., :1]], -1), b, rtol=0, atol=1e-5)  # blank: first vs last

    torch.save(theirs.state_dict(), tmp_path / "doctr.pt")  # and back: --init-from a docTR file
    torch.manual_seed(1)
    fresh = task.build_model()
    assert load_initial_weights(fresh, tmp_path / "doctr.pt", task.arch) == len(state)
    loaded = fresh.state_dict()
    for k, v in ours.state_dict().items():
        assert torch.equal(loaded[k], v), k


def test_scale_ocrs_dbnets_are_doctrs_dbnets_in_another_layout(tmp_path):
    for arch in ("db_mobilenet_v3_large", "db_resnet50"):
        torch.manual_seed(0)
        ours = create_model(arch, input_size=(128, 128)).eval()
        doctr_arch, state = doctr_state_dict(ours, arch)
        theirs = getattr(doctr_models, doctr_arch)(pretrained=False, pretrained_backbone=False).eval()
        theirs.load_state_dict(state, strict=True)
        x = torch.randn(2, 3, 128, 128)
        with torch.no_grad():
            torch.testing.assert_close(torch.sigmoid(ours(x)["logits"]), theirs(x, return_model_output=True)["out_map"],
                                       rtol=0, atol=1e-6)
        torch.save(theirs.state_dict(), tmp_path / "doctr.pt")  # and back: --init-from docTR's DBNet file
        fresh = create_model(arch, input_size=(128, 128))
        assert load_initial_weights(fresh, tmp_path / "doctr.pt", arch) == len(state)
        loaded = fresh.state_dict()  # once: building it per key walks all 394 of db_resnet50's tensors each time
        assert all(torch.equal(loaded[k], v) for k, v in ours.state_dict().items())
    with pytest.raises(UserError, match="vitstr_tiny has no docTR counterpart"):
        doctr_state_dict(create_model("vitstr_tiny"), "vitstr_tiny")


def test_init_from_refuses_weights_of_another_shape_and_files_that_are_not_state_dicts(tmp_path):
    model = create_model("crnn_mobilenet_v3_small", num_classes=11)
    torch.save(create_model("crnn_mobilenet_v3_small", num_classes=12).state_dict(), tmp_path / "other.pt")
    with pytest.raises(UserError, match=r"does not fit crnn_mobilenet_v3_small: 2 of another shape \(e.g. head.weight"):
        load_initial_weights(model, tmp_path / "other.pt", "crnn_mobilenet_v3_small")
    torch.save([1, 2], tmp_path / "list.pt")
    with pytest.raises(UserError, match="is not a state dict"):
        load_initial_weights(model, tmp_path / "list.pt", "crnn_mobilenet_v3_small")
    with pytest.raises(UserError, match="does not exist"):
        load_initial_weights(model, tmp_path / "missing.pt", "crnn_mobilenet_v3_small")


def test_without_the_extra_a_doctr_name_says_how_to_install_it(monkeypatch):
    from scale_ocr.models import registry

    monkeypatch.setattr(registry, "_MODELS", {k: v for k, v in registry._MODELS.items() if ":" not in k})
    monkeypatch.setitem(sys.modules, "doctr", None)  # import doctr -> ImportError
    monkeypatch.setitem(sys.modules, "doctr.models", None)
    with pytest.raises(UserError, match=r"pip install 'scale-ocr\[doctr\]'"):
        model_entry("doctr:vitstr_small")
    with pytest.raises(UserError, match="unknown docTR model 'doctr:nope'; choose one of: doctr:crnn_vgg16_bn"):
        model_entry("doctr:nope")


@pytest.mark.parametrize("arch", ["db_mobilenet_v3_large", "fast_tiny"])
def test_a_doctr_detector_is_doctrs_class_with_doctrs_targets_loss_and_boxes(arch):
    from scale_ocr.tasks.detection import PageCollate

    task = create_task(ModelConfig(arch=f"doctr:{arch}", input_size=(128, 128)))
    assert task.name == "doctr_detection" and task.mean == (0.798, 0.785, 0.772)  # docTR's normalisation
    torch.manual_seed(0)
    model = task.build_model().eval()
    theirs = getattr(doctr_models, arch)(pretrained=False, pretrained_backbone=False).eval()
    theirs.load_state_dict(model.state_dict(), strict=True)
    assert isinstance(model, type(theirs))
    # Pages with 2, 0 and 1 words (input pixels): the padded layout carries each page's own polygons.
    words = [np.float32([[[8, 8], [60, 8], [60, 24], [8, 24]], [[20, 70], [120, 64], [122, 90], [22, 96]]]),
             np.zeros((0, 4, 2), np.float32), np.float32([[[30, 40], [90, 40], [90, 60], [30, 60]]])]
    batch = PageCollate(task.targets)([(torch.randn(3, 128, 128), w, [], True) for w in words])
    assert batch.maps["polygons"].shape == (3, 2, 4, 2) and batch.maps["counts"].tolist() == [2, 0, 1]
    with torch.no_grad():
        ours = model(*batch.inputs)
        target = [{"words": w / np.float32(128)} for w in words]
        ref = theirs(batch.images, target=target, return_model_output=True, return_preds=True)
        bare = model(batch.images)
    assert float(ours["loss"]) == pytest.approx(float(ref["loss"]), rel=1e-6)  # docTR's own targets and loss
    torch.testing.assert_close(ours["probs"], ref["out_map"], rtol=0, atol=0)
    assert set(bare) == {"probs"}
    probs = task.probabilities(bare)
    for i in range(3):  # docTR's post-processor's boxes, as scale_ocr's Box corners
        boxes = np.float64([[*b.polygon[0], *b.polygon[2], b.score] for b in task.boxes(probs[i])]).reshape(-1, 5)
        np.testing.assert_allclose(boxes, ref["preds"][i]["words"][:, :5], atol=1e-6)
