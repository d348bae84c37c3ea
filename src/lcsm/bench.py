"""`python -m lcsm.bench`: see lcsm.inference.bench."""

from lcsm.inference.bench import main
from titan.tools.cli import run

if __name__ == "__main__":
    run(main)
