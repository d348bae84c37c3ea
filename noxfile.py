"""Sessions per component. They all run in the environment nox itself runs from (the project venv),
so no session builds its own 5 GB torch environment: `pip install -e '.[data,dev]'` once, then `nox -s NAME`.
"""

import nox

nox.options.default_venv_backend = "none"
nox.options.sessions = ["lint", "tests"]


@nox.session
def tests(session):
    """The whole suite as CI runs it (slow tests excluded)."""
    session.run("python", "-m", "pytest", "-q", *session.posargs)


@nox.session
def titan(session):
    """Engine and Llama tests."""
    session.run("python", "-m", "pytest", "-q", "tests/titan", *session.posargs)


@nox.session
def lcsm(session):
    """Hyena and Flash Inference tests."""
    session.run("python", "-m", "pytest", "-q", "tests/lcsm", *session.posargs)


@nox.session
def morphens(session):
    """MotherNets ensemble tests."""
    session.run("python", "-m", "pytest", "-q", "tests/morphens", *session.posargs)


@nox.session
def slow(session):
    """Long runs CI skips (many ranks, big sweeps)."""
    session.run("python", "-m", "pytest", "-q", "-m", "slow", *session.posargs)


@nox.session
def lint(session):
    session.run("python", "-m", "ruff", "check", "src", "tests", "benchmarks", "noxfile.py")


@nox.session
def train(session):
    """The default debug run (`python -m titan.train`), overrides after `--`."""
    session.run("python", "-m", "titan.train", *session.posargs)


@nox.session
def bench_titan(session):
    """Trainer vs a bare PyTorch loop, tokens/s ratio."""
    session.run("python", "benchmarks/titan_overhead.py", *session.posargs)


@nox.session
def bench_lcsm(session):
    session.run("python", "-m", "lcsm.bench", *session.posargs)


@nox.session
def bench_morphens(session):
    session.run("python", "-m", "morphens.run", "--sizes", "1,2,4,8", *session.posargs)
