"""lcsm: Hyena long-convolution language models and Flash Inference, exact online convolution in O(L log^2 L).

- lcsm.model: the Hyena LM (training path, FFT long convolutions) and its titan ModelSpec;
- lcsm.inference: online convolution engines (lazy / eager / recompute / flash), tile schedules and tau kernels,
  data-dependent filters, the per-token decode step, generation and the benchmark.
The public paths `python -m lcsm.bench`, `python -m lcsm.generate` and `model.spec = "lcsm.hyena"` are the
three small modules at this level.
"""
