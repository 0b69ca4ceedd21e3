"""`python -m pipefisher` runs the command line."""

import sys

from pipefisher.cli import main

sys.exit(main())
