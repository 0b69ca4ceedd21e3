"""`python -m pipefisher` runs the command line."""

import sys

from pipefisher.cli.main import main

sys.exit(main())
