"""`python -m lcsm.generate`: see lcsm.inference.generate."""

from lcsm.inference.generate import main
from titan.tools.cli import run

if __name__ == "__main__":
    run(main)
