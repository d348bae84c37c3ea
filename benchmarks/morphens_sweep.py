"""MotherNets vs independent training at K = 1, 2, 4, 8 on Fashion-MNIST, side by side in one run.

`python benchmarks/morphens_sweep.py [--section.key value ...]` writes results.json and results.png under
outputs/morphens/fashion_sweep (see configs/morphens/fashion_sweep.toml; --sizes 1,2,4,8,16 extends it).
"""

import sys
from pathlib import Path

from morphens.run import main

CONFIG = Path(__file__).resolve().parents[1] / "configs/morphens/fashion_sweep.toml"

if __name__ == "__main__":
    sys.exit(main(["--config", str(CONFIG), *sys.argv[1:]]))
