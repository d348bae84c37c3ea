"""The CPU recipe table of issue 7: `python -m titan.compare` with presets for the debug and a ~100M Llama.

    python benchmarks/titan_recipes.py [--preset debug|100m] [titan.compare options] [--section.key value ...]

Defaults: recipes baseline,+compile,+selective_ac,+full_ac,+float8, 20 steps x 2 rounds, output under
outputs/bench_titan_recipes/<preset>. Later options win, so any of them can be overridden.
"""

from __future__ import annotations

import sys

from titan.compare.harness import main

PRESETS = {
    "debug": ["--config", "configs/titan/debug.toml"],
    # ~95M parameters: 14 blocks 768 wide with the corpus BPE; seq 512 keeps a CPU step within seconds.
    "100m": ["--config", "configs/titan/debug.toml", "--model.dim", "768", "--model.n_layers", "14",
             "--model.n_heads", "12", "--model.n_kv_heads", "4", "--training.seq_len", "512",
             "--training.local_batch_size", "4"],
}


def build_argv(argv: list[str]) -> list[str]:
    preset = "debug"
    if "--preset" in argv:
        i = argv.index("--preset")
        preset = argv[i + 1] if i + 1 < len(argv) else ""
        argv = argv[:i] + argv[i + 2:]
    if preset not in PRESETS:
        raise SystemExit(f"error: --preset must be one of {', '.join(PRESETS)}, got {preset!r}")
    defaults = ["--recipes", "baseline,+compile,+selective_ac,+full_ac,+float8", "--steps", "20", "--rounds", "2",
                "--out", f"outputs/bench_titan_recipes/{preset}"]
    return [*defaults, *PRESETS[preset], *argv]


if __name__ == "__main__":
    sys.exit(main(build_argv(sys.argv[1:])))
