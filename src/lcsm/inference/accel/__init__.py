"""Accelerations of lcsm's inference that pay off on some machines, behind one switch.

- native (steps.c, steps_module.c): lazy's and flash's engine steps and the Hyena LM's decode step in C, built once
  per machine with the system's C compiler;
- block_exit: the Hyena LM's decode step compiled ahead of time by AOTInductor;
- decode: the decode states that run them (decode="compiled" and "native");
- autotune: choices timed once per machine and cached (hybrid tau's kernel per tile size, flash's tile batching);
- tau_triton: the Toeplitz tile as a Triton kernel (CUDA, or Triton's CPU interpreter).

The switch: the environment variable LCSM_ACCEL=0 turns every one of them off. Then the engines step with tensor
ops, decoding is eager, every timed choice takes its first candidate untimed (the fft tau, tiles batched over
slots) and the triton tau is unavailable. That plain torch path is the reference: the tests check each acceleration
against it, and it against the FFT convolution and the model's parallel forward.
"""

import os


def enabled() -> bool:
    """False where LCSM_ACCEL=0: the plain torch path everywhere."""
    return os.environ.get("LCSM_ACCEL", "1") != "0"
