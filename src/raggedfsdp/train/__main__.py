"""``python -m raggedfsdp.train``: one training worker (what torchrun starts)."""

import os
import sys

from .job import main

if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: Gloo sometimes aborts there after all work is done (SIGABRT),
    # and a non-zero exit would make torchrun's agent restart a finished job.
    os._exit(code)
