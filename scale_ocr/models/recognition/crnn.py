"""CRNN: convolutional backbone -> column features -> BiLSTM -> per-frame classes, trained with CTC.

The torchvision backbones' later stride-2 stages become (2, 1) strides, as docTR's do: a stock MobileNetV3 leaves a
128-pixel-wide word 4 columns, far too few CTC frames; two square reductions leave W/4 = 32.
"""

from __future__ import annotations

from typing import Any

import torch
from einops import rearrange
from torch import nn
from torchvision import models as tvm

from scale_ocr.models.keys import key_prefix
from scale_ocr.models.recognition.ctc import BLANK_PRIOR, blank_bias, ctc_loss, frame_lengths
from scale_ocr.models.registry import register_model


def rectify_strides(features: nn.Module, keep_square: int = 2) -> None:
    """Keep the first ``keep_square`` spatial reductions square; make later ones halve height only.

    Works on conv strides (MobileNet) and max-pool kernels (VGG) alike, walking modules in order.
    """
    seen = 0
    for module in features.modules():
        if isinstance(module, nn.Conv2d) and module.stride == (2, 2):
            seen += 1
            if seen > keep_square:
                module.stride = (2, 1)
        elif isinstance(module, nn.MaxPool2d) and module.stride in (2, (2, 2)):
            seen += 1
            if seen > keep_square:
                module.kernel_size, module.stride, module.padding = (2, 1), (2, 1), 0


# torchvision's MobileNetV3 gives its BatchNorms momentum 0.01 (made for ImageNet's long runs): the running statistics
# that validation, export and predict read then trail the weights by about 100 steps, so early in a run the model
# reads held-out words far worse than it trains. torch's default, 0.1 (VGG16-BN's own), follows within about 10
# steps; training is unchanged, as it normalises with each batch's own statistics.
BN_MOMENTUM = 0.1


class OwnLengthLSTM(nn.LSTM):
    """A batch-first bidirectional LSTM that also reads a right-padded batch at each item's own length
    (``forward(seq, lengths)``): its outputs are a packed sequence's, without packing.

    torch's LSTM on a packed sequence steps through time on its own code, one small product per frame, and on CPU
    its time varied up to nearly 4x between batches of the same shape and like lengths (issue 57: the two ranks
    of a round waited for each other 15% of each step). Here every layer and direction is one call of the fused
    kernel (oneDNN's on CPU, cuDNN's on a GPU) over the padded batch: the forward direction reads the padding only
    after an item's own frames; the backward direction reads each item reversed within its own frames, so it
    starts at the item's last frame. Frames after an item's length come out 0, as ``pad_packed_sequence`` gives.
    The weights, their names and what ``forward(seq)`` gives are nn.LSTM's."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not (self.batch_first and self.bidirectional and self.proj_size == 0):
            raise ValueError("OwnLengthLSTM reads own lengths for batch-first bidirectional LSTMs without projection")

    def forward(self, seq, lengths: torch.Tensor | None = None):  # type: ignore[override]
        if lengths is None:
            return super().forward(seq)
        frames = torch.arange(seq.shape[1], device=seq.device)
        lengths = lengths.to(seq.device)
        valid = frames[None, :] < lengths[:, None]  # (B, T)
        # each item reversed within its own frames; padding stays where it is (an involution: it also undoes)
        flip = torch.where(valid, lengths[:, None] - 1 - frames[None, :], frames[None, :])
        zeros = seq.new_zeros(1, seq.shape[0], self.hidden_size)
        kinds = ("weight_ih", "weight_hh", "bias_ih", "bias_hh")[:4 if self.bias else 2]
        x = seq
        for layer in range(self.num_layers):
            outs = []
            for suffix, backward in ((f"_l{layer}", False), (f"_l{layer}_reverse", True)):
                weights = [getattr(self, f"{kind}{suffix}") for kind in kinds]
                inp = reorder(x, flip) if backward else x
                out = torch.lstm(inp, (zeros, zeros), weights, self.bias, 1, 0.0, self.training, False, True)[0]
                outs.append(reorder(out, flip) if backward else out)
            x = torch.cat(outs, dim=-1)
            if self.dropout and self.training and layer < self.num_layers - 1:
                x = nn.functional.dropout(x, self.dropout, training=True)
        return x * valid[..., None].to(x.dtype), None


def reorder(seq: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``seq`` (B, T, C) with each item's frames taken in ``index``'s (B, T) order."""
    return seq.gather(1, index[..., None].expand(-1, -1, seq.shape[-1]))


DOCTR_NAMES = {"backbone.": "feat_extractor.", "rnn.": "decoder.", "head.": "linear."}  # ours -> docTR's


class CRNN(nn.Module):
    """CRNN recognizer: ``backbone`` maps (B, 3, H, W) images to (B, ``feat_channels``, ``feat_height``, W/4)
    features; ``num_classes`` is the vocabulary size + 1 (class 0 is the CTC blank)."""

    def __init__(self, backbone: nn.Module, feat_channels: int, feat_height: int, num_classes: int,
                 rnn_units: int = 128) -> None:
        super().__init__()
        self.backbone = backbone
        self.rnn = OwnLengthLSTM(feat_channels * feat_height, rnn_units, num_layers=2, bidirectional=True,
                                 batch_first=True)
        self.head = nn.Linear(2 * rnn_units, num_classes)
        with torch.no_grad():  # CTC's blank plateau: start where CTC's first lesson ends (ctc.BLANK_PRIOR)
            self.head.bias[0] = blank_bias(num_classes, BLANK_PRIOR)

    doctr_arch: str | None = None  # docTR's name for the same architecture (set by the builders below)
    channels_last = True  # convolutional: faster fed NHWC images (ModelConfig.channels_last)

    def to_doctr_state_dict(self, state: dict[str, torch.Tensor]) -> tuple[str, dict[str, torch.Tensor]]:
        """``state`` in docTR's CRNN layout: the same layers under docTR's names, the CTC blank last (docTR's
        class ``len(vocab)``) instead of first. Checked: identical logits up to that permutation."""
        out = {}
        for k, v in state.items():
            prefix = key_prefix(k, DOCTR_NAMES)
            k = DOCTR_NAMES[prefix] + k[len(prefix):]
            out[k] = torch.cat([v[1:], v[:1]]) if prefix == "head." else v
        return self.doctr_arch, out

    def from_doctr_state_dict(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The inverse of :meth:`to_doctr_state_dict`: docTR's CRNN weights in this model's layout."""
        back = {v: k for k, v in DOCTR_NAMES.items()}
        out = {}
        for k, v in state.items():
            prefix = key_prefix(k, back)
            out[back[prefix] + k[len(prefix):]] = torch.cat([v[-1:], v[:-1]]) if prefix == "linear." else v
        return out

    def sharding_units(self) -> list[nn.Module]:
        """Sub-modules that FSDP shards one by one (each backbone stage, the RNN, the head)."""
        return [*self.backbone.children(), self.rnn, self.head]

    def checkpoint_units(self) -> list[nn.Module]:
        """What ``--activation-checkpointing`` recomputes: each backbone stage (where the activations are)."""
        return list(self.backbone.children())

    def forward(self, images: torch.Tensor, targets: torch.Tensor | None = None,
                target_lengths: torch.Tensor | None = None,
                widths: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Logits (B, frames, classes), and the CTC loss when ``targets`` are given. ``widths``: each image's own
        columns in a batch padded on the right (crops read at their own width); its frames are then ``lengths``
        in the output, and the BiLSTM, the loss and decoding read no frame after them. The convolutions see the
        padding as they see a word crop's: the crop's border colour."""
        feats = self.backbone(images)
        seq = rearrange(feats, "b c h w -> b w (c h)")
        lengths = None if widths is None else frame_lengths(widths, images.shape[-1], seq.shape[1])
        seq, _ = self.rnn(seq, lengths)  # with lengths, the backward direction starts at each item's last frame
        logits = self.head(seq)
        out = {"logits": logits} if lengths is None else {"logits": logits, "lengths": lengths}
        if targets is not None and target_lengths is not None:
            out["loss"] = ctc_loss(logits, targets, target_lengths, lengths=lengths)
        return out


def _probe(backbone: nn.Module, input_size: tuple[int, int]) -> tuple[int, int]:
    """Channels and height of the backbone's output for ``input_size`` (one tiny dry run)."""
    was_training = backbone.training
    backbone.eval()
    with torch.no_grad():
        out = backbone(torch.zeros(1, 3, *input_size))
    backbone.train(was_training)
    return out.shape[1], out.shape[2]


def _crnn(features: nn.Module, num_classes: int, input_size: tuple[int, int], rnn_units: int,
          doctr_arch: str) -> CRNN:
    rectify_strides(features)
    for module in features.modules():
        if isinstance(module, nn.BatchNorm2d):
            module.momentum = BN_MOMENTUM
    channels, height = _probe(features, input_size)
    model = CRNN(features, channels, height, num_classes, rnn_units)
    model.doctr_arch = doctr_arch
    return model


# CTC's blank plateau: at AdamW 1e-3 a MobileNet CRNN predicts only blanks for hundreds of steps; at 3e-3 it
# leaves the plateau about twice as soon (benchmarks/convergence.py), found before the head started at the blank's
# prior (ctc.BLANK_PRIOR), which shortens the plateau again. The VGG backbone keeps the general default.
MOBILENET_CRNN_LR = 3e-3
MOBILENET_CRNN_BATCH = 64  # the global batch that rate was found at (2 ranks x 32 words), docTR's -b 64 too


@register_model(default_lr=MOBILENET_CRNN_LR, reference_batch=MOBILENET_CRNN_BATCH)
def crnn_mobilenet_v3_small(num_classes: int = 95, input_size: tuple[int, int] = (32, 128),
                            rnn_units: int = 128) -> CRNN:
    """CRNN on a MobileNetV3-Small backbone (about 2.2M parameters with the default vocabulary)."""
    return _crnn(tvm.mobilenet_v3_small(weights=None).features, num_classes, input_size, rnn_units,
                 "crnn_mobilenet_v3_small")


@register_model(default_lr=MOBILENET_CRNN_LR, reference_batch=MOBILENET_CRNN_BATCH)
def crnn_mobilenet_v3_large(num_classes: int = 95, input_size: tuple[int, int] = (32, 128),
                            rnn_units: int = 128) -> CRNN:
    """CRNN on a MobileNetV3-Large backbone."""
    return _crnn(tvm.mobilenet_v3_large(weights=None).features, num_classes, input_size, rnn_units,
                 "crnn_mobilenet_v3_large")


@register_model
def crnn_vgg16_bn(num_classes: int = 95, input_size: tuple[int, int] = (32, 128), rnn_units: int = 128) -> CRNN:
    """CRNN on a VGG16-BN backbone, docTR's default recognizer."""
    return _crnn(tvm.vgg16_bn(weights=None).features, num_classes, input_size, rnn_units, "crnn_vgg16_bn")
