"""One frontier table and plot from several runs' results.json (e.g. a frontier's budgets run as separate
processes at once, each with its methods side by side).

`python benchmarks/morphens_merge.py OUT RUN1/results.json RUN2/results.json ...` prints the table and writes
OUT/results.png.
"""

import sys

from morphens import report

if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    print(report.table(report.merge(sys.argv[2:], sys.argv[1])))
