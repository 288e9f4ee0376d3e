"""``python -m raggedfsdp.cli``: the ``raggedfsdp`` command.

What the tests and benchmarks run without the console script.
"""

from . import main

if __name__ == "__main__":
    raise SystemExit(main())
