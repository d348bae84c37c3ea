from titan.compare.harness import main
from titan.tools.cli import run

run(main)
