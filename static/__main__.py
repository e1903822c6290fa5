import sys

from static.cli import main

sys.exit(main())
