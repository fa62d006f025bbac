"""``python -m scale_ocr`` is the ``scale-ocr`` command."""

import sys

from scale_ocr.cli.main import main

sys.exit(main())
