"""`python -m strata ...`: the same as the `strata` command."""
import sys

from strata.cli.main import main

sys.exit(main())
