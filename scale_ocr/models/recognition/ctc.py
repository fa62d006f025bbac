"""CTC loss and greedy decoding shared by the recognition models."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from scale_ocr.config import FRAME_WIDTH
from scale_ocr.vocab import Vocab

# CTC's blank plateau: from torch's default initialisation a head finds every class about as likely as the blank,
# so its first lesson is that most frames are blank, and it then reads nothing for long. A head that starts at the
# blank's share of frames (about 0.8 in a 32-frame word of 3-8 characters) leaves the plateau far sooner (the
# convergence record in benchmarks/results/README.md).
BLANK_PRIOR = 0.8


def ctc_frames(input_size: tuple[int, int]) -> int:
    """CTC frames the models emit for an ``(H, W)`` input: one per ``FRAME_WIDTH`` columns."""
    return input_size[1] // FRAME_WIDTH


def ctc_frames_needed(word: str) -> int:
    """The fewest frames CTC can align ``word`` to: one per character, plus a blank between repeats.

    Greedy decoding merges equal neighbouring frames, so the "ll" of "hello" needs "l", blank, "l".
    A word needing more frames than the model emits has no alignment: its loss is infinite (zeroed
    by ``zero_infinity``), so it would silently teach the model nothing.
    """
    return len(word) + sum(a == b for a, b in zip(word, word[1:], strict=False))


def frame_lengths(widths: torch.Tensor, input_width: int, frames: int) -> torch.Tensor:
    """The frames of each item of a batch padded to ``input_width`` columns that ``frames`` frames cover, when the
    items are ``widths`` columns wide: the frames that see any of an item's own columns (padding makes the rest)."""
    return torch.div(widths.long() * frames + input_width - 1, input_width, rounding_mode="floor").clamp_(1, frames)


def blank_bias(num_classes: int, prior: float) -> float:
    """The blank's (class 0's) bias that makes a head whose other logits are near 0 predict blank with probability
    ``prior``: ``softmax`` gives it ``e^b / (e^b + num_classes - 1)``."""
    return math.log(prior / (1 - prior) * (num_classes - 1))


def ctc_loss(logits: torch.Tensor, targets: torch.Tensor, target_lengths: torch.Tensor,
             reduction: str = "mean", lengths: torch.Tensor | None = None) -> torch.Tensor:
    """CTC loss of ``logits`` (B, T, C) against padded ``targets`` (B, L); blank is class 0.

    Each word's loss is divided by its length; ``"mean"`` averages over the batch, ``"none"``
    returns one value per word. ``lengths``: each item's own frames (crops read at their own width); the frames
    after them are padding, which CTC never reads. Default: all T.

    Computed in fp32 whatever the autocast dtype: CTC's log-space sums lose too much in bf16/fp16.
    """
    log_probs = F.log_softmax(logits.float(), dim=-1).transpose(0, 1)  # (T, B, C)
    input_lengths = torch.full((logits.shape[0],), logits.shape[1], dtype=torch.long, device=logits.device) \
        if lengths is None else lengths.to(logits.device, torch.long)
    with torch.autocast(device_type=logits.device.type, enabled=False):
        losses = F.ctc_loss(log_probs, targets, input_lengths, target_lengths, blank=0, reduction="none",
                            zero_infinity=True)
    losses = losses / target_lengths.clamp(min=1).to(losses.dtype)
    return losses.mean() if reduction == "mean" else losses


Run = tuple[int, int, int, float]  # (class, first frame, last frame, probability at the first frame)


@torch.no_grad()
def ctc_greedy_runs(logits: torch.Tensor, lengths: torch.Tensor | None = None) -> list[list[Run]]:
    """Best path per item (argmax per frame, of its ``lengths`` frames, all where None) as the characters it emits:
    each run of one non-blank class, with its frames."""
    probs = logits.float().softmax(-1)
    best_p, best = probs.max(-1)  # (B, T)
    ends = [logits.shape[1]] * logits.shape[0] if lengths is None else lengths.tolist()
    out = []
    for seq, p, end in zip(best.tolist(), best_p.tolist(), ends, strict=True):
        runs: list[list] = []
        prev = 0
        for frame, (idx, prob) in enumerate(zip(seq[:end], p[:end], strict=True)):
            if idx != prev and idx != 0:
                runs.append([idx, frame, frame, prob])
            elif idx == prev and idx != 0:
                runs[-1][2] = frame
            prev = idx
        out.append([tuple(r) for r in runs])
    return out


def ctc_greedy_decode(logits: torch.Tensor, vocab: Vocab,
                      lengths: torch.Tensor | None = None) -> tuple[list[str], list[float]]:
    """Best-path decoding: argmax per frame, merge repeats, drop blanks; ``lengths``: each item's own frames (the
    padding's after them are not read).

    Returns the words and a confidence per word: the lowest probability among the frames that
    produced a character (docTR's convention), 0 for an empty word.
    """
    runs = ctc_greedy_runs(logits, lengths)
    return [vocab.decode([r[0] for r in item]) for item in runs], [min((r[3] for r in item), default=0.0)
                                                                   for item in runs]


def ctc_word_spans(logits: torch.Tensor, vocab: Vocab, lengths: torch.Tensor | None = None
                   ) -> list[list[tuple[str, float, int, int]]]:
    """Each item's text as its words (parted by the vocabulary's space), each ``(word, confidence, first frame,
    end frame)``: the frames from its first character's first to its last character's last, plus one."""
    out = []
    for item in ctc_greedy_runs(logits, lengths):
        words: list[list[Run]] = [[]]
        for run in item:
            if vocab.chars[run[0] - 1] == " ":
                words.append([])
            else:
                words[-1].append(run)
        out.append([(vocab.decode([r[0] for r in w]), min(r[3] for r in w), w[0][1], w[-1][2] + 1)
                    for w in words if w])
    return out
