import sys

from kvtier.serve.cli import main

sys.exit(main())
