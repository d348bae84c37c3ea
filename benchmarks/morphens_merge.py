"""One frontier table and plot from several runs' results.json (e.g. a frontier's budgets run as separate
processes at once, each with its methods side by side).

`python benchmarks/morphens_merge.py [--cpu] OUT RUN1/results.json RUN2/results.json ...` prints the table and
writes OUT/results.png (time axis in CPU seconds with --cpu: the figure that a loaded machine does not inflate).
"""

import sys

from morphens import report

if __name__ == "__main__":
    cpu = "--cpu" in sys.argv
    args = [a for a in sys.argv[1:] if a != "--cpu"]
    if len(args) < 2:
        sys.exit(__doc__)
    print(report.table(report.merge(args[1:], args[0], cpu)))
