"""`python -m services.cli ARGS`: the `rlhf` command."""

import sys

from . import main

sys.exit(main())
