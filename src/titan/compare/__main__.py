import sys

from titan.compare.harness import main

sys.exit(main(sys.argv[1:]))
