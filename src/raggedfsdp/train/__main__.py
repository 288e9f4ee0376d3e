"""``python -m raggedfsdp.train``: one training worker (what torchrun starts)."""

import sys

from .job import main

if __name__ == "__main__":
    sys.exit(main())
