"""`python -m lcsm.generate`: see lcsm.inference.generate."""

import sys

from lcsm.inference.generate import main

if __name__ == "__main__":
    sys.exit(main())
