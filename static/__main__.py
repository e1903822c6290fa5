"""`python -m static`: the same entry point as the `static` command."""

import sys

from static.cli import main

sys.exit(main())
