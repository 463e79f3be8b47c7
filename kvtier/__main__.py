import sys

from kvtier.cli.main import main

sys.exit(main())
