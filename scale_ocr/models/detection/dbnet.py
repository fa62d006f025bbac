"""DBNet (Liao et al. 2020): backbone -> FPN -> probability and threshold maps, trained with the DB loss.

Four torchvision backbone stages (strides 4-32) fused at stride 4; only the probability map is needed at
inference, so the threshold head is skipped in eval mode (docs/models.md).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torchvision import models as tvm

from scale_ocr.models.detection.loss import db_loss
from scale_ocr.models.detection.sizes import check_input_size
from scale_ocr.models.keys import rename_prefixes
from scale_ocr.models.registry import register_model

# features[0:4] ends at index 3 (stride 4), [4:7] at 6 (stride 8), [7:13] at 12 (stride 16), [13:17] at 16
# (stride 32, the final 960-channel 1x1 conv): the same taps as docTR's db_mobilenet_v3_large.
MOBILENET_V3_LARGE_STAGES = ((0, 4), (4, 7), (7, 13), (13, 17))


def _conv_bn_relu(c_in: int, c_out: int, kernel: int) -> nn.Sequential:
    # No conv bias: the BatchNorm that follows has its own.
    return nn.Sequential(nn.Conv2d(c_in, c_out, kernel, padding=kernel // 2, bias=False), nn.BatchNorm2d(c_out),
                         nn.ReLU(inplace=True))


class FPN(nn.Module):
    """Feature pyramid: 1x1 laterals, top-down upsample + add, a 3x3 conv per level, concat at stride 4.

    docTR's ``FeaturePyramidNetwork`` computation exactly (bilinear, corner-aligned upsampling), so that a DBNet
    here and docTR's DBNet of the same backbone give the same maps from the same weights. ``in_channels``:
    shallowest level first; ``out_channels``: the laterals' and the fused output's width (a share per level).
    """

    def __init__(self, in_channels: Sequence[int], out_channels: int) -> None:
        super().__init__()
        if out_channels % len(in_channels):
            raise ValueError(f"FPN width {out_channels} must split evenly over {len(in_channels)} levels")
        self.lateral = nn.ModuleList(_conv_bn_relu(c, out_channels, 1) for c in in_channels)
        self.smooth = nn.ModuleList(_conv_bn_relu(out_channels, out_channels // len(in_channels), 3)
                                    for _ in in_channels)

    def forward(self, feats: Sequence[torch.Tensor]) -> torch.Tensor:
        lat = [conv(f) for conv, f in zip(self.lateral, feats, strict=True)]
        for i in range(len(lat) - 2, -1, -1):  # top-down: coarse semantics flow into finer levels
            lat[i] = lat[i] + F.interpolate(lat[i + 1], size=lat[i].shape[-2:], mode="bilinear", align_corners=True)
        size = lat[0].shape[-2:]
        outs = [conv(x) for conv, x in zip(self.smooth, lat, strict=True)]
        outs = [outs[0]] + [F.interpolate(x, size=size, mode="bilinear", align_corners=True) for x in outs[1:]]
        return torch.cat(outs, dim=1)


def _head(channels: int) -> nn.Sequential:
    """Conv3x3-BN-ReLU, then two stride-2 transposed convs: stride 4 features -> one full-size map."""
    mid = channels // 4
    return nn.Sequential(
        nn.Conv2d(channels, mid, 3, padding=1, bias=False), nn.BatchNorm2d(mid), nn.ReLU(inplace=True),
        nn.ConvTranspose2d(mid, mid, 2, stride=2, bias=False), nn.BatchNorm2d(mid), nn.ReLU(inplace=True),
        nn.ConvTranspose2d(mid, 1, 2, stride=2),
    )


class DBNet(nn.Module):
    """DBNet text detector over four backbone ``stages`` ending at strides 4, 8, 16 and 32."""

    doctr_arch: str | None = None  # docTR's name for the same architecture (set by the builders below)
    channels_last = True  # convolutional: faster fed NHWC images (ModelConfig.channels_last)
    doctr_names: dict[str, str] = {}  # key prefixes, ours -> docTR's

    def __init__(self, stages: Sequence[nn.Module], stage_channels: Sequence[int], fpn_channels: int) -> None:
        super().__init__()
        self.stages = nn.ModuleList(stages)
        self.neck = FPN(stage_channels, fpn_channels)
        self.prob_head = _head(fpn_channels)
        self.thresh_head = _head(fpn_channels)

    def to_doctr_state_dict(self, state: dict[str, torch.Tensor]) -> tuple[str, dict[str, torch.Tensor]]:
        """``state`` in docTR's DBNet layout: the same layers under docTR's names (checked: identical maps)."""
        return self.doctr_arch, rename_prefixes(state, self.doctr_names)

    def from_doctr_state_dict(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The inverse of :meth:`to_doctr_state_dict`: docTR's DBNet weights in this model's layout."""
        return rename_prefixes(state, {v: k for k, v in self.doctr_names.items()})

    def sharding_units(self) -> list[nn.Module]:
        """Sub-modules that FSDP shards one by one (each backbone stage, the neck, each head)."""
        return [*self.stages, self.neck, self.prob_head, self.thresh_head]

    def checkpoint_units(self) -> list[nn.Module]:
        """What ``--activation-checkpointing`` recomputes: each backbone stage."""
        return list(self.stages)

    def forward(self, images: torch.Tensor, prob_target: torch.Tensor | None = None,
                prob_mask: torch.Tensor | None = None, thresh_target: torch.Tensor | None = None,
                thresh_mask: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """``logits`` (B, 1, H, W); ``thresh`` (its sigmoid map) in training mode or with targets; given all four
        (B, H, W) targets, ``losses`` per sample (validation masks padded samples with it) and ``loss``, their mean.
        """
        targets = (prob_target, prob_mask, thresh_target, thresh_mask)
        given = sum(t is not None for t in targets)
        if given not in (0, len(targets)):
            raise ValueError("DBNet.forward needs all four targets (prob/thresh target and mask) or none")
        check_input_size(*images.shape[-2:])
        feats, x = [], images
        for stage in self.stages:
            x = stage(x)
            feats.append(x)
        fused = self.neck(feats)
        out = {"logits": self.prob_head(fused)}
        if given or self.training:
            out["thresh"] = torch.sigmoid(self.thresh_head(fused))
        if given:
            out["losses"] = db_loss(out["logits"], out["thresh"], *targets, reduction="none")
            out["loss"] = out["losses"].mean()
        return out


# docTR's detection training script (references/detection/train_pytorch.py) trains DBNet with Adam at 1e-3 on
# batches of 2 pages: the rate here is docTR's, untuned in scale_ocr, so it is stated at docTR's batch.
DOCTR_DETECTION_BATCH = 2


@register_model(task="detection", reference_batch=DOCTR_DETECTION_BATCH)
def db_mobilenet_v3_large(input_size: tuple[int, int] = (512, 512), **_) -> DBNet:
    """DBNet on a MobileNetV3-Large backbone (about 4.2M parameters); other kwargs are ignored."""
    check_input_size(*input_size)
    features = tvm.mobilenet_v3_large(weights=None).features
    stages = [features[a:b] for a, b in MOBILENET_V3_LARGE_STAGES]
    model = DBNet(stages, (24, 40, 112, 960), fpn_channels=256)
    # docTR's feature extractor is the whole `features` Sequential; a slice of it keeps the layers' indices.
    return _doctr_twin(model, "db_mobilenet_v3_large", {
        f"stages.{s}.{j}.": f"feat_extractor.{j}." for s, (a, b) in enumerate(MOBILENET_V3_LARGE_STAGES)
        for j in range(a, b)})


@register_model(task="detection", reference_batch=DOCTR_DETECTION_BATCH)
def db_resnet50(input_size: tuple[int, int] = (512, 512), **_) -> DBNet:
    """DBNet on a ResNet-50 backbone, docTR's default detector; other kwargs are ignored."""
    check_input_size(*input_size)
    r = tvm.resnet50(weights=None)
    # The stem joins layer1 (stride 4); avgpool and fc are dropped, so no parameter goes unused under DDP.
    stages = [nn.Sequential(r.conv1, r.bn1, r.relu, r.maxpool, r.layer1), r.layer2, r.layer3, r.layer4]
    model = DBNet(stages, (256, 512, 1024, 2048), fpn_channels=256)
    return _doctr_twin(model, "db_resnet50", {
        "stages.0.0.": "feat_extractor.conv1.", "stages.0.1.": "feat_extractor.bn1.",
        "stages.0.4.": "feat_extractor.layer1.", "stages.1.": "feat_extractor.layer2.",
        "stages.2.": "feat_extractor.layer3.", "stages.3.": "feat_extractor.layer4."})


def _doctr_twin(model: DBNet, arch: str, backbone_names: dict[str, str]) -> DBNet:
    """``model`` marked as docTR's ``arch``: its backbone's key prefixes map as given, the rest by name."""
    model.doctr_arch = arch
    model.doctr_names = {**backbone_names, "neck.lateral.": "fpn.in_branches.", "neck.smooth.": "fpn.out_branches.",
                         "prob_head.": "prob_head.", "thresh_head.": "thresh_head."}
    return model
