"""`python -m strata.serve`: the same as `strata serve`."""
import sys

from strata.cli.serve import main

sys.exit(main())
