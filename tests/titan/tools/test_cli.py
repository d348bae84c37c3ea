"""The exit contract every entry point shares: user error 2 with one line, signal 130/143, bug keeps its traceback."""

import os
import signal
import subprocess
import sys

import pytest

from titan.tools.cli import Interrupted, UserError, duration, entry_point, report_done


@entry_point
def command(argv):
    what = argv[0]
    if what == "user":
        raise UserError("training.steps must be > 0, got -1\nsecond line never shown")
    if what == "bug":
        raise ValueError("an internal invariant broke")
    if what == "sigint":
        raise KeyboardInterrupt
    if what == "sigterm":
        os.kill(os.getpid(), signal.SIGTERM)
        raise AssertionError("SIGTERM should have raised")
    if what == "interrupted":
        raise Interrupted(signal.SIGTERM, "stopped after step 7, checkpoint step-7 saved")
    return 0


@pytest.mark.parametrize("what, code, line", [
    ("user", 2, "error: training.steps must be > 0, got -1"),
    ("sigint", 130, "interrupted by SIGINT"),
    ("sigterm", 143, "interrupted by SIGTERM"),
    ("interrupted", 143, "interrupted by SIGTERM: stopped after step 7, checkpoint step-7 saved"),
])
def test_one_line_and_the_exit_code(capsys, what, code, line):
    assert command([what]) == code
    assert capsys.readouterr().err.strip().splitlines() == [line]


def test_a_bug_keeps_its_traceback():
    with pytest.raises(ValueError, match="internal invariant"):
        command(["bug"])


def test_sigterm_handler_is_restored_afterwards():
    before = signal.getsignal(signal.SIGTERM)
    command(["ok"])
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_bug_in_a_real_process_exits_1_with_its_traceback(tmp_path):
    script = tmp_path / "cmd.py"
    script.write_text("from titan.tools.cli import entry_point, run\n\n@entry_point\ndef main(argv):\n"
                      "    raise KeyError('no such thing')\n\nrun(main)\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "Traceback (most recent call last)" in proc.stderr and "KeyError: 'no such thing'" in proc.stderr


@pytest.mark.parametrize("body, code, err", [("import argparse; argparse.ArgumentParser().parse_args(['-h'])", 0, ""),
                                             ("import argparse; argparse.ArgumentParser().parse_args(['-x'])", 2,
                                              "error: unrecognized arguments: -x")],
                         ids=["help", "usage_error"])
def test_argparse_exits_keep_their_code_and_no_traceback(tmp_path, body, code, err):
    # lcsm.bench --help and titan.compare --help once printed a SystemExit traceback and exited 1.
    script = tmp_path / "cmd.py"
    script.write_text(f"from titan.tools.cli import entry_point, run\n\n@entry_point\ndef main(argv):\n"
                      f"    {body}\n\nrun(main)\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == code and "Traceback" not in proc.stderr
    assert err in proc.stderr


@pytest.mark.parametrize("seconds, text", [(4.26, "4.3s"), (59.9, "59.9s"), (135, "2m15s"), (3725, "1h02m")])
def test_a_duration_reads_as_minutes_and_seconds(seconds, text):
    assert duration(seconds) == text


def test_the_summary_line_is_printed_by_rank_zero_only(capsys, monkeypatch):
    line = "done: 300 steps in 2m15s, loss 8.83 -> 5.76, outputs in outputs/debug (metrics.jsonl)"
    assert report_done("300 steps", 135, "loss 8.83 -> 5.76", "outputs/debug (metrics.jsonl)") == line
    monkeypatch.setenv("RANK", "1")
    report_done("300 steps", 135, "", "outputs/debug")
    assert capsys.readouterr().out == line + "\n"
