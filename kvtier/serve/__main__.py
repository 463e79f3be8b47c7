"""`python -m kvtier.serve`: the same as `kvtier serve`."""

import sys

from kvtier.cli.main import main

sys.exit(main(["serve", *sys.argv[1:]]))
