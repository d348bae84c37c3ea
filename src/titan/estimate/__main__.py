import sys

from titan.estimate.dry_run import main

sys.exit(main(sys.argv[1:]))
