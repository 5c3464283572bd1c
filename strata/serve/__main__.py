"""`python -m strata.serve`: the same as `strata serve`."""
import sys

from strata.serve.cli import main

sys.exit(main())
