"""`python -m pipefisher` runs the command line."""

import sys

from pipefisher.cli.entry import main

sys.exit(main())
