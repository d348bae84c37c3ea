"""tests/launch.py gives what `subprocess.run([python, -m, ...])` and torchrun give: output, exit codes, ranks."""

import os
import sys

import pytest

from tests.launch import run_module

ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


@pytest.fixture
def script(tmp_path, monkeypatch):
    """A module `probe` in a folder of its own, run from that folder as `python -m probe` would be."""
    monkeypatch.chdir(tmp_path)

    def write(source: str) -> str:
        (tmp_path / "probe.py").write_text(source)
        return "probe"

    return write


def test_output_exit_code_argv_and_environment_are_the_processes(script):
    module = script(
        "import os, sys\n"
        "print('out', sys.argv[1:], os.environ['PROBE'], __name__)\n"
        "print('err', file=sys.stderr)\n"
        "sys.exit(3)\n"
    )
    proc = run_module(module, ["a", "--b"], {**ENV, "PROBE": "x"})
    assert proc.returncode == 3
    assert proc.stdout == "out ['a', '--b'] x __main__\n" and proc.stderr == "err\n"
    assert "PROBE" not in os.environ, "the child's environment is its own"


def test_our_packages_are_imported_fresh_in_each_process_and_torch_is_preloaded(script):
    module = script(
        "import sys\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'titan', 'lcsm', 'morphens', 'tests'}),"
        " 'torch' in sys.modules)\n"
    )
    assert run_module(module, [], ENV).stdout == "['tests'] True\n"  # tests.launch: the child's own entry


def test_an_exception_prints_its_traceback_and_exits_1(script):
    proc = run_module(script("raise ValueError('boom')\n"), [], ENV)
    assert proc.returncode == 1
    assert "Traceback" in proc.stderr and "ValueError: boom" in proc.stderr.splitlines()[-1]


def test_a_string_exit_prints_it_and_exits_1(script):
    proc = run_module(script("raise SystemExit('error: no such file')\n"), [], ENV)
    assert (proc.returncode, proc.stderr) == (1, "error: no such file\n")


def test_non_daemon_threads_and_atexit_handlers_run_before_the_exit(script):
    module = script(
        "import atexit, threading, time\n"
        "atexit.register(print, 'atexit')\n"
        "threading.Thread(target=lambda: (time.sleep(0.2), print('thread'))).start()\n"
    )
    proc = run_module(module, [], ENV)
    assert (proc.returncode, proc.stdout) == (0, "thread\natexit\n")


def test_ranks_get_torchruns_environment_and_form_a_process_group(script):
    module = script(
        "import os, sys, torch.distributed as dist, torch\n"
        "dist.init_process_group('gloo')\n"
        "t = torch.tensor([float(dist.get_rank())])\n"
        "dist.all_reduce(t)\n"
        "e = os.environ\n"
        "sys.stdout.write(f\"{e['RANK']} {e['LOCAL_RANK']} {e['WORLD_SIZE']} {int(t.item())}\\n\")\n"
        "dist.destroy_process_group()\n"
    )
    proc = run_module(module, [], ENV, nproc=3)
    assert proc.returncode == 0, proc.stderr
    # One write per line: unbuffered ranks share one file, as under torchrun, so print's pieces would interleave.
    assert sorted(proc.stdout.splitlines()) == ["0 0 3 3", "1 1 3 3", "2 2 3 3"]


def test_one_failed_rank_stops_the_others_and_the_job_exits_1(script):
    module = script("import os, sys, time\nif os.environ['RANK'] == '1':\n    sys.exit(2)\ntime.sleep(600)\n")
    proc = run_module(module, [], ENV, nproc=2, timeout=60)
    assert proc.returncode == 1


def test_an_interpreter_level_variable_gets_a_fresh_interpreter_and_a_warning(script):
    module = script("import sys\nprint(sys.flags.hash_randomization)\n")
    with pytest.warns(UserWarning, match="PYTHONHASHSEED differ from the fork server's environment"):
        assert run_module(module, [], {**ENV, "PYTHONHASHSEED": "0"}).stdout == "0\n"


def test_a_timeout_raises_as_subprocess_does(script):
    import subprocess

    with pytest.raises(subprocess.TimeoutExpired):
        run_module(script("import time\nprint('started', flush=True)\ntime.sleep(600)\n"), [], ENV, timeout=3)


def test_the_entry_point_runs_with_the_suites_interpreter():
    proc = run_module("titan.train", ["--help"], ENV)
    assert proc.returncode == 0 and "--training.steps" in proc.stdout
    assert proc.args[0] == sys.executable
