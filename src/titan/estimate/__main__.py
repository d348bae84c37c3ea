from titan.estimate.dry_run import main
from titan.tools.cli import run

run(main)
