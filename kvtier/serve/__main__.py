import sys

from kvtier.cli.serve import main

sys.exit(main())
