"""``python -m mbmem_overlays.cli``."""

import sys

from . import main

sys.exit(main())
