"""scale-ocr benchmarks (a regular package, so it wins over fairscale's top-level `benchmarks`)."""

from scale_ocr.errors import require_installed

require_installed()  # every benchmark imports torch: a Python without it ends in one line
