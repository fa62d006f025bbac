"""docTR's own recognizer and detector trained at scale and handed back to docTR (its predictors, built from the
two exported files); fine-tuning from a docTR state dict."""

from __future__ import annotations

import json

import doctr.models as doctr_models
import numpy as np
import pytest
import torch
from conftest import REPO, TINY, deepspeed_train, fixture_dir, make_folder, read_jsonl, read_metrics, torchrun_train
from PIL import Image

from scale_ocr.checkpoint.export import load_any
from scale_ocr.cli.main import main as cli_main

ARCH = "crnn_mobilenet_v3_small"
WORDS = ["abc", "Été", "42€", "word", "XyZ", "gloo"]


@pytest.fixture(scope="module")
def zero3_reco(tmp_path_factory):
    """docTR's CRNN trained on 2 ranks under ZeRO-3, launched by `deepspeed` with the generic strategy on a
    user's JSON (the shipped zero3.json; engines do not see the launcher)."""
    with fixture_dir(tmp_path_factory, "doctr_reco") as root:
        proc = deepspeed_train([f"doctr:{ARCH}", "--strategy", "deepspeed", "--ds-config",
                                str(REPO / "ds_configs" / "zero3.json"), *TINY, "--save-every", "6",
                                "--output-dir", str(root / "run")])
        assert proc.returncode == 0, proc.stderr[-3000:]
        yield root / "run"


@pytest.mark.slow
def test_doctr_recognizer_trained_under_zero3_goes_back_to_doctr_and_reads_the_same(zero3_reco, tmp_path, capsys):
    """The ZeRO-3 run exported for docTR: docTR's class loads it strictly, docTR's predictor reads the same words
    with the same confidences as `scale-ocr predict`, and the logits equal the checkpoint's."""
    run_dir = zero3_reco
    m = read_metrics(run_dir)
    assert m["launcher"] == "deepspeed" and m["world_size"] == 2 and m["steps"] == 6 and m["state_bytes"]["params"] > 0
    assert json.loads((run_dir / "config.json").read_text())["ds_config"]["zero_optimization"]["stage"] == 3
    out = tmp_path / "reco.pt"
    assert cli_main(["export", str(run_dir), str(out), "--format", "doctr"]) == 0  # the CLI, in this process
    info = json.loads(out.with_suffix(".json").read_text(encoding="utf-8"))
    assert info["doctr_arch"] == ARCH and info["padding"] == "black"
    theirs = getattr(doctr_models, ARCH)(pretrained=False, pretrained_backbone=False, vocab=info["vocab"])
    theirs.load_state_dict(torch.load(out, weights_only=True), strict=True)
    theirs.eval()

    folder = make_folder(tmp_path / "crops", {f"{i}.png": w for i, w in enumerate(WORDS)})
    images = sorted(str(p) for p in (folder / "images").iterdir())
    predictor = doctr_models.recognition_predictor(theirs).eval()
    with torch.no_grad():
        ref = predictor([np.asarray(Image.open(p).convert("RGB")) for p in images])
    capsys.readouterr()
    assert cli_main(["predict", str(run_dir), *images]) == 0
    ours = [line.split("\t") for line in capsys.readouterr().out.strip().splitlines()]
    assert [o[1] if len(o) == 3 else "" for o in ours] == [w for w, _ in ref]
    assert [float(o[-1]) for o in ours] == pytest.approx([c for _, c in ref], abs=1e-4)  # printed to 4 decimals

    live = load_any(run_dir)  # the checkpoint itself, in scale_ocr
    x = torch.randn(3, 3, 32, 128)
    with torch.no_grad():
        torch.testing.assert_close(live.model(x)["logits"], theirs(x, return_model_output=True)["out_map"],
                                   rtol=0, atol=1e-5)


@pytest.mark.slow
def test_doctr_detector_trained_under_fsdp_goes_back_to_doctrs_ocr_predictor(zero3_reco, tmp_path, capsys):
    """docTR's DBNet on 2 ranks under FSDP2 (docTR's own targets and loss from the pages' polygons), exported for
    docTR: its class loads it strictly, the probability maps equal the checkpoint's, docTR's detection predictor
    finds the boxes `scale-ocr predict` finds, and the README's snippet builds docTR's ocr_predictor from the two
    exported files (this detector, the ZeRO-3 recognizer) and reads a page with it."""
    from scale_ocr.data.synthetic_pages import SyntheticPages

    det_arch = "db_mobilenet_v3_large"
    run_dir = tmp_path / "det"
    proc = torchrun_train([f"doctr:{det_arch}", "--strategy", "fsdp", "--input-size", "128x128", "-b", "1",
                           "--train-samples", "4", "--val-samples", "2", "--max-steps", "2", "--save-every", "2",
                           "--log-every", "1", "--lr", "1e-3", "--wandb-mode", "disabled",
                           "--output-dir", str(run_dir)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = read_metrics(run_dir)
    assert m["task"] == "doctr_detection" and m["steps"] == 2 and m["strategy"] == "fsdp"
    det_out, reco_out = tmp_path / "det.pt", tmp_path / "reco.pt"
    assert cli_main(["export", str(run_dir), str(det_out), "--format", "doctr"]) == 0
    assert cli_main(["export", str(zero3_reco), str(reco_out), "--format", "doctr"]) == 0

    # The README's snippet, as a user runs it.
    info = json.load(open(reco_out.with_suffix(".json")))
    reco = doctr_models.crnn_mobilenet_v3_small(pretrained=False, pretrained_backbone=False, vocab=info["vocab"])
    reco.load_state_dict(torch.load(reco_out, weights_only=True), strict=True)
    reco.cfg = {**reco.cfg, "mean": tuple(info["mean"]), "std": tuple(info["std"])}
    det_info = json.load(open(det_out.with_suffix(".json")))
    det = getattr(doctr_models, det_info["doctr_arch"])(pretrained=False, pretrained_backbone=False)
    det.load_state_dict(torch.load(det_out, weights_only=True), strict=True)
    det.cfg = {**det.cfg, **{k: tuple(det_info[k]) for k in ("input_shape", "mean", "std")}}  # as it trained
    predictor = doctr_models.ocr_predictor(det_arch=det.eval(), reco_arch=reco.eval())

    page = SyntheticPages(1, 7, (128, 128), "abcdefghij")[0][0]  # a 128x128 page: no resize on either side
    page.save(tmp_path / "page.png")
    with torch.no_grad():
        doc = predictor([np.asarray(page)])
        ref = doctr_models.detection_predictor(det)([np.asarray(page)])[0]["words"]
    assert len(doc.pages) == 1 and doc.pages[0].dimensions == (128, 128)
    capsys.readouterr()
    assert cli_main(["predict", str(run_dir), str(tmp_path / "page.png")]) == 0
    ours = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["boxes"]
    found = np.float64([[*b["polygon"][0], *b["polygon"][2], b["score"]] for b in ours]).reshape(-1, 5)
    np.testing.assert_allclose(found, ref[:, :5] * [128, 128, 128, 128, 1], atol=0.06)  # printed to 1 and 4 decimals

    live = load_any(run_dir)
    x = torch.randn(2, 3, 128, 128)
    with torch.no_grad():
        torch.testing.assert_close(live.model(x)["probs"], det(x, return_model_output=True)["out_map"],
                                   rtol=0, atol=1e-5)


@pytest.mark.slow
def test_fine_tuning_a_doctr_state_dict_under_fsdp_starts_from_its_weights_and_loss(tmp_path):
    """A docTR model the user trained (here: 15 steps on 16 words), saved as docTR saves it, is fine-tuned on
    the same words under FSDP on 2 ranks at a vanishing rate: its weights are the file's, its first loss the
    trained model's (not a fresh model's)."""
    from scale_ocr.config import ModelConfig
    from scale_ocr.tasks import create_task

    words = [w + str(i % 10) for i, w in enumerate(WORDS * 3)][:16]
    folder = make_folder(tmp_path / "words", {f"{i}.png": w for i, w in enumerate(words)})
    task = create_task(ModelConfig(arch=f"doctr:{ARCH}"))
    tf = task.transform(train=False)  # what the run sees with --no-augment
    images = torch.stack([tf(Image.open(folder / "images" / f"{i}.png").convert("RGB")) for i in range(16)])
    torch.manual_seed(0)
    theirs = getattr(doctr_models, ARCH)(pretrained=False, pretrained_backbone=False).train()
    opt = torch.optim.Adam(theirs.parameters(), lr=3e-3)
    losses = []
    for _ in range(15):
        loss = theirs(images, target=words)["loss"]
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    with torch.no_grad():
        trained = float(theirs(images, target=words)["loss"])
    fresh = losses[0]
    assert trained < 0.7 * fresh, losses  # it learned something to continue from
    torch.save(theirs.state_dict(), tmp_path / "mine.pt")

    run_dir = tmp_path / "run"
    proc = torchrun_train([f"doctr:{ARCH}", "--strategy", "fsdp", "--train-path", str(folder),
                           "--val-path", str(folder),
                           "--no-augment", "-b", "8", "--max-steps", "2", "--log-every", "1", "--lr", "1e-12",
                           "--sched", "constant", "--init-from", str(tmp_path / "mine.pt"), "--wandb-mode", "disabled",
                           "--output-dir", str(run_dir)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"initial weights: {len(theirs.state_dict())} tensors from" in proc.stdout
    first = next(r["train/loss"] for r in read_jsonl(run_dir) if "train/loss" in r)
    assert abs(first - trained) < 0.2 * (fresh - trained), (first, trained, fresh)
    after = torch.load(run_dir / "last_model.pt", weights_only=True)
    for name, p in theirs.named_parameters():  # BatchNorm's running statistics move in training; weights do not
        torch.testing.assert_close(after[name], p.detach(), rtol=0, atol=1e-9, msg=name)
