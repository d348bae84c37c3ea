"""Sessions per component. They all run in the environment nox itself runs from (the project venv),
so no session builds its own 5 GB torch environment: `pip install -e '.[data,dev]'` once, then `nox -s NAME`.
"""

import os
import sys
from pathlib import Path

import nox

# The interpreter nox itself runs under: the project venv, even when nox is started as .venv/bin/nox.
PY = sys.executable

nox.options.default_venv_backend = "none"
nox.options.sessions = ["lint", "tests"]


@nox.session
def tests(session):
    """The whole suite as CI runs it (slow tests excluded)."""
    session.run(PY, "-m", "pytest", "-q", *session.posargs)


@nox.session
def titan(session):
    """Engine and Llama tests."""
    session.run(PY, "-m", "pytest", "-q", "tests/titan", *session.posargs)


@nox.session
def lcsm(session):
    """Hyena and Flash Inference tests."""
    session.run(PY, "-m", "pytest", "-q", "tests/lcsm", *session.posargs)


@nox.session
def morphens(session):
    """MotherNets ensemble tests."""
    session.run(PY, "-m", "pytest", "-q", "tests/morphens", *session.posargs)


OLDEST_SUPPORTED = {"torch": "2.11.0", "torchvision": "0.26.0"}
"""The low end of pyproject's torch range; CI installs the high end (2.14.1)."""


@nox.session
def compat(session):
    """The fast suite (or the tests named after `--`) on the oldest supported torch, in a venv of its own that is
    kept between runs: $TITAN_COMPAT_VENV, default .nox/compat-torch-2.11 (created on first use: ~3 GB download)."""
    venv = Path(os.environ.get("TITAN_COMPAT_VENV", ".nox/compat-torch-2.11")).absolute()
    python = str(venv / "bin" / "python")
    if not (venv / "bin" / "python").exists():
        session.run(sys.executable, "-m", "venv", str(venv))
    pins = Path(session.create_tmp()) / "oldest-torch.txt"
    pins.write_text("".join(f"{name}=={version}\n" for name, version in OLDEST_SUPPORTED.items()))
    # The pins as a constraint (replacing any machine-wide one): the project's other dependencies resolve
    # against this torch instead of pulling the newest.
    session.run(python, "-m", "pip", "install", "-q", "-e", ".[data,dev]", env={"PIP_CONSTRAINT": str(pins)})
    session.run(python, "-c", "import torch, torchvision; print('compat: torch', torch.__version__, "
                "'torchvision', torchvision.__version__)")
    session.run(python, "-m", "pytest", "-q", *session.posargs, env={"PYTHONPATH": str(Path("src").absolute())})


@nox.session
def slow(session):
    """Long runs CI skips (many ranks, big sweeps)."""
    session.run(PY, "-m", "pytest", "-q", "-m", "slow", *session.posargs)


@nox.session
def elastic_trials(session):
    """Kill-and-resume reliability: elastic runs with a rank SIGKILLed, one line per trial (PASSED = identical
    losses to an uninterrupted run)."""
    session.run(PY, "-m", "pytest", "-v", "-m", "slow", "--durations=0",
                "tests/titan/checkpoint/test_recovery.py::test_killed_and_resumed_runs_match_an_uninterrupted_one",
                *session.posargs)


@nox.session
def lint(session):
    session.run(PY, "-m", "ruff", "check", "src", "tests", "benchmarks", "noxfile.py")


@nox.session
def train(session):
    """The default debug run (`python -m titan.train`), overrides after `--`."""
    session.run(PY, "-m", "titan.train", *session.posargs)


@nox.session
def bench_titan(session):
    """Trainer vs a bare PyTorch loop, tokens/s ratio."""
    session.run(PY, "benchmarks/titan_overhead.py", *session.posargs)


@nox.session
def bench_comm(session):
    """Comm bytes per step of each parallel layout (measured vs estimated) and step time vs FSDP, 4 gloo ranks."""
    session.run(PY, "benchmarks/titan_comm.py", *session.posargs)


@nox.session
def bench_lcsm(session):
    session.run(PY, "-m", "lcsm.bench", *session.posargs)


@nox.session
def bench_morphens(session):
    session.run(PY, "-m", "morphens.run", "--sizes", "1,2,4,8", *session.posargs)
