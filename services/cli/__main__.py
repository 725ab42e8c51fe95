"""`python -m services.cli ARGS`: the `rlhf` command."""

import sys

from . import main

if __name__ == "__main__":  # not when a spawned child process imports this as its parent's main
    sys.exit(main())
