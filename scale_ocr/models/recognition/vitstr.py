"""ViTSTR: a plain Vision Transformer over word images, read out per column with CTC.

Unlike docTR's (cross-entropy off the first tokens), the patch grid's averaged columns are CTC frames, so it trains
like CRNN: one more model family for every strategy (all-Linear, no BatchNorm), from 5M parameters to billions.
"""

from __future__ import annotations

import torch
from einops import rearrange
from torch import nn
from torch.nn import functional as F

from scale_ocr.errors import UserError
from scale_ocr.models.recognition.ctc import ctc_loss, frame_lengths
from scale_ocr.models.registry import register_model


class SelfAttention(nn.Module):
    """Multi-head self-attention with ``nn.MultiheadAttention``'s parameters and names (checkpoints of either load
    into the other), projecting q, k and v in one product with the whole ``in_proj_weight``.

    Under ZeRO-3 query, key and value are distinct tensors, so ``nn.MultiheadAttention`` would project with three
    slices of the weight, which autograd saves: a slice keeps the whole gathered weight alive after DeepSpeed has
    released it, every block at once. A product with the parameter itself lets DeepSpeed release and re-gather it.
    """

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.num_heads = heads  # nn.MultiheadAttention's name
        self.in_proj_weight = nn.Parameter(torch.empty(3 * dim, dim))
        self.in_proj_bias = nn.Parameter(torch.zeros(3 * dim))
        self.out_proj = nn.Linear(dim, dim)
        nn.init.xavier_uniform_(self.in_proj_weight)  # nn.MultiheadAttention's (ViTSTR.init_param re-initialises)

    def forward(self, x: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        """``keep``: (B, 1, 1, N) True where a token may be attended to (padding's are not); None: all."""
        qkv = F.linear(x, self.in_proj_weight, self.in_proj_bias)
        q, k, v = rearrange(qkv, "b n (three h e) -> three b h n e", three=3, h=self.num_heads)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        return self.out_proj(rearrange(out, "b h n e -> b n (h e)"))


class Block(nn.Module):
    """Pre-norm transformer block (attention + MLP), the unit FSDP shards."""

    def __init__(self, dim: int, heads: int, mlp_ratio: float = 4.0) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = SelfAttention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        hidden = int(dim * mlp_ratio)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))

    def forward(self, x: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), keep)
        return x + self.mlp(self.norm2(x))


class ViTSTR(nn.Module):
    """ViT recognizer: ``num_classes`` is the vocabulary size + 1 (class 0 is the CTC blank); ``input_size`` (H, W)
    must be a multiple of ``patch`` (ph, pw), and W / pw is the number of CTC frames."""

    def __init__(self, num_classes: int, input_size: tuple[int, int], patch: tuple[int, int], dim: int,
                 depth: int, heads: int, mlp_ratio: float = 4.0) -> None:
        super().__init__()
        (h, w), (ph, pw) = input_size, patch
        if h % ph or w % pw:
            raise UserError(f"--input-size {h}x{w} is not a multiple of the {ph}x{pw} patch; use e.g. 32x128")
        if dim % heads:
            fits = [n for n in range(max(1, heads - 8), heads + 9) if dim % n == 0]
            raise UserError(f"a width of {dim} does not split into {heads} attention heads (--model-width, "
                            f"--model-heads); give --model-heads that divides it, e.g. "
                            f"{min(fits, key=lambda n: abs(n - heads))}")
        self.grid = (h // ph, w // pw)
        self.patch_embed = nn.Conv2d(3, dim, kernel_size=patch, stride=patch)
        self.pos_embed = nn.Parameter(torch.zeros(1, self.grid[0] * self.grid[1], dim))
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        self.blocks = nn.ModuleList(Block(dim, heads, mlp_ratio) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def init_param(self, name: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
        """timm's ViT initialisation, by parameter name: truncated normal (std 0.02) for projections, attention
        and the patch and position embeddings, zero biases, unit LayerNorm scales (see scale_ocr.models.init)."""
        if name.endswith("bias"):
            tensor.zero_()
        elif tensor.ndim == 1:
            tensor.fill_(1.0)
        else:
            nn.init.trunc_normal_(tensor, std=0.02, generator=generator)

    def sharding_units(self) -> list[nn.Module]:
        """Each transformer block is one FSDP unit; embeddings, norm and head go with the root."""
        return list(self.blocks)

    def checkpoint_units(self) -> list[nn.Module]:
        """What ``--activation-checkpointing`` recomputes: each transformer block."""
        return list(self.blocks)

    def forward(self, images: torch.Tensor, targets: torch.Tensor | None = None,
                target_lengths: torch.Tensor | None = None,
                widths: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Logits (B, patch columns, classes), and the CTC loss when ``targets`` are given.

        ``widths``: each image's own columns in a batch padded on the right (crops read at their own width, up to
        the built width). The rule for a narrower input: the patch in row r and column c takes the position
        embedding of row r and column c of the built grid, counted from the left edge, whatever the input's width.
        No token attends to a padding column's patches; the columns an item covers are ``lengths`` in the output,
        and the loss and decoding read no frame after them."""
        x = self.patch_embed(images)
        rows, cols = x.shape[2:]
        if rows != self.grid[0] or cols > self.grid[1]:
            raise UserError(f"an input of {images.shape[-2]}x{images.shape[-1]} pixels does not fit this model's "
                            f"{self.grid[0]}x{self.grid[1]} patch grid; give inputs of its height, at most as wide")
        pos = self.pos_embed if cols == self.grid[1] else \
            rearrange(self.pos_embed, "1 (h w) d -> 1 h w d", h=rows)[:, :, :cols].flatten(1, 2)
        x = rearrange(x, "b d h w -> b (h w) d") + pos
        lengths = keep = None
        if widths is not None:
            lengths = frame_lengths(widths, images.shape[-1], cols)
            own = torch.arange(cols, device=x.device) < lengths.to(x.device)[:, None]  # (B, cols)
            keep = own.repeat(1, rows)[:, None, None, :]  # tokens are row-major: every row's columns in turn
        for block in self.blocks:
            x = block(x) if keep is None else block(x, keep)
        x = rearrange(self.norm(x), "b (h w) d -> b w h d", h=rows).mean(dim=2)  # one frame per column
        logits = self.head(x)
        out = {"logits": logits} if lengths is None else {"logits": logits, "lengths": lengths}
        if targets is not None and target_lengths is not None:
            out["loss"] = ctc_loss(logits, targets, target_lengths, lengths=lengths)
        return out


HEAD_DIM = 64  # ViT's width per attention head; a width given without heads gets width / 64 of them


def _vitstr(num_classes: int, input_size: tuple[int, int], width: int, depth: int, heads: int | None = None,
            mlp_ratio: float | None = None, patch: tuple[int, int] = (8, 4)) -> ViTSTR:
    heads = heads or max(1, width // HEAD_DIM)
    return ViTSTR(num_classes, tuple(input_size), patch, width, depth, heads, 4.0 if mlp_ratio is None else mlp_ratio)


def _size(width: int, depth: int, heads: int, name: str, about: str):
    """A registered ViTSTR size whose width, depth, heads and MLP ratio can each be overridden."""

    def build(num_classes: int = 95, input_size: tuple[int, int] = (32, 128), width: int | None = None,
              depth: int | None = None, heads: int | None = None, mlp_ratio: float | None = None) -> ViTSTR:
        # Heads follow an overridden width (width / 64) unless given; the named size's own heads otherwise.
        heads = heads or (None if width else default_heads)
        return _vitstr(num_classes, input_size, width or default_width, depth or default_depth, heads, mlp_ratio)

    default_width, default_depth, default_heads = width, depth, heads
    build.__name__ = build.__qualname__ = name
    build.__doc__ = f"{about} Overrides: ``width``, ``depth``, ``heads``, ``mlp_ratio``."
    return register_model(build)


vitstr_tiny = _size(192, 12, 3, "vitstr_tiny", "ViT-Tiny width (192, 3 heads), 12 blocks: about 5.4M parameters.")
vitstr_small = _size(384, 12, 6, "vitstr_small", "ViT-Small width (384, 6 heads), 12 blocks: about 21M parameters.")
vitstr_base = _size(768, 12, 12, "vitstr_base", "ViT-Base width (768, 12 heads), 12 blocks: about 85M parameters.")
vitstr_large = _size(1024, 24, 16, "vitstr_large", "ViT-Large width (1024, 16 heads), 24 blocks: about 303M "
                                                   "parameters.")
