"""The DB loss (Liao et al. 2020): L = Ls + alpha * Lb + beta * Lt.

* Ls: balanced BCE on the probability map, with hard negative mining (at most ``neg_ratio``
  negatives per positive, chosen per sample as the highest-loss ones).
* Lb: dice loss on the approximate binary map sigmoid(k * (P - T)), which is what trains the
  threshold map to separate touching words.
* Lt: L1 between the threshold map and its target, inside the dilated text regions only.

The paper weights alpha = 1 and beta = 10. Everything is computed in float32 with autocast off: the
sorted negatives, sums over ~250k pixels and the k = 50 sharpening all lose too much in bf16/fp16.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

DB_K = 50.0  # the paper's amplifying factor: steep enough to act as a step, smooth enough to train


def approx_binary(prob_logits: torch.Tensor, thresh_map: torch.Tensor, k: float = DB_K) -> torch.Tensor:
    """Differentiable binarization sigmoid(k * (sigmoid(prob_logits) - thresh_map)).

    Both P and T lie in (0, 1), so the argument stays within +-k: the sigmoid neither overflows
    nor saturates to exact 0/1 in float32.
    """
    return torch.sigmoid(k * (torch.sigmoid(prob_logits.float()) - thresh_map.float()))


def _balanced_bce(logits: torch.Tensor, target: torch.Tensor, mask: torch.Tensor, neg_ratio: float,
                  eps: float) -> torch.Tensor:
    """Per-sample BCE over all positives and the hardest ``neg_ratio`` x as many negatives; (B, N) -> (B,)."""
    bce = F.binary_cross_entropy_with_logits(logits, target, reduction="none")
    pos, neg = target * mask, (1 - target) * mask
    n_pos = pos.sum(1)
    n_neg = torch.minimum(neg.sum(1), neg_ratio * n_pos)
    # A full sort instead of topk(k=max n_neg): no host sync for k, so it stays graph/compile friendly.
    # Positive and ignored pixels sort last with value 0 and add nothing.
    hardest = torch.sort(bce * neg, dim=1, descending=True).values
    rank = torch.arange(hardest.shape[1], device=logits.device)
    neg_loss = (hardest * (rank[None, :] < n_neg[:, None])).sum(1)
    return ((bce * pos).sum(1) + neg_loss) / (n_pos + n_neg + eps)


def _dice(pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor, smooth: float) -> torch.Tensor:
    """Per-sample dice loss; (B, N) -> (B,).

    The ``smooth`` term in numerator and denominator makes a page without text score 0 when nothing
    is predicted (and close to 1 when text is hallucinated) instead of a constant 1 with no gradient.
    """
    inter = (pred * target * mask).sum(1)
    union = (pred * mask).sum(1) + (target * mask).sum(1)
    return 1 - (2 * inter + smooth) / (union + smooth)


def db_loss(prob_logits: torch.Tensor, thresh_map: torch.Tensor, prob_target: torch.Tensor,
            prob_mask: torch.Tensor, thresh_target: torch.Tensor, thresh_mask: torch.Tensor,
            reduction: str = "mean", alpha: float = 1.0, beta: float = 10.0, neg_ratio: float = 3.0,
            eps: float = 1e-6) -> torch.Tensor:
    """DB loss of one batch: a float32 scalar, or one loss per sample (B,) for ``reduction="none"``.

    ``prob_logits`` (raw) and ``thresh_map`` (after its sigmoid) are (B, 1, H, W) or (B, H, W); the targets and
    masks are :func:`~scale_ocr.models.detection.targets.build_targets`' maps, (B, H, W). ``eps`` keeps empty pages
    (no positives, no threshold region) finite.
    """
    if reduction not in ("mean", "none"):
        raise ValueError(f"reduction must be 'mean' or 'none', not {reduction!r}")
    b = prob_logits.shape[0]
    with torch.autocast(device_type=prob_logits.device.type, enabled=False):
        logits, thresh = prob_logits.float().reshape(b, -1), thresh_map.float().reshape(b, -1)
        target, mask = prob_target.float().reshape(b, -1), prob_mask.float().reshape(b, -1)
        t_target, t_mask = thresh_target.float().reshape(b, -1), thresh_mask.float().reshape(b, -1)

        ls = _balanced_bce(logits, target, mask, neg_ratio, eps)
        lb = _dice(approx_binary(logits, thresh), target, mask, smooth=1.0)
        lt = ((thresh - t_target).abs() * t_mask).sum(1) / (t_mask.sum(1) + eps)
        losses = ls + alpha * lb + beta * lt
    return losses.mean() if reduction == "mean" else losses
