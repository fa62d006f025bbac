"""Input sizes a detector accepts: DBNet's FPN (scale_ocr's and docTR's) divides the input by 32 exactly."""

from __future__ import annotations

from scale_ocr.errors import UserError

STRIDE = 32  # the deepest feature level; every FPN level must divide the input exactly


def check_input_size(height: int, width: int, flag: str = "--input-size") -> None:
    """Raise a UserError, naming ``flag``, unless both sides are positive multiples of 32."""
    if height % STRIDE or width % STRIDE or height <= 0 or width <= 0:
        h, w = (max(STRIDE, round(s / STRIDE) * STRIDE) for s in (height, width))
        raise UserError(f"{flag} {height}x{width}: DBNet needs height and width that are multiples of "
                        f"{STRIDE}, e.g. {h}x{w}")
