"""`python -m lcsm.bench`: see lcsm.inference.bench."""

import sys

from lcsm.inference.bench import main

if __name__ == "__main__":
    sys.exit(main())
