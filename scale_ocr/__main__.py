"""``python -m scale_ocr`` is the ``scale-ocr`` command."""

import sys

from scale_ocr.errors import require_installed

require_installed()  # before torch: a Python without it ends in one line

from scale_ocr.cli.main import main  # noqa: E402

sys.exit(main())
