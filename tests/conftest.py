import os

# Tests share two cores with other test processes: one intra-op thread per process keeps runs predictable.
os.environ.setdefault("OMP_NUM_THREADS", "1")
