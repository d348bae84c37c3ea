"""Building C code once: the file appears whole or not at all, a second call (or a concurrent process) builds
nothing, and a failure is returned as its last line, with nothing left behind; the machine's name includes the
instruction sets its CPU enables, and a compiler is one that is on the PATH."""

import ctypes
import subprocess
import sys

import pytest

from titan.tools.native import FLAGS, LIBS, build_once, compiler, processor

SOURCE = "int answer(void) { return 42; }\n"


@pytest.fixture
def cc():
    found = compiler()
    if found is None:
        pytest.skip("no C compiler on this machine")
    return found


def test_builds_once_and_the_library_works(tmp_path, cc):
    (tmp_path / "a.c").write_text(SOURCE)
    path = tmp_path / "cache" / "a.so"
    calls = []

    def command(out):
        calls.append(out)
        return [cc, *FLAGS, str(tmp_path / "a.c"), "-o", str(out), *LIBS]

    assert build_once(path, command) is None and build_once(path, command) is None
    assert len(calls) == 1 and calls[0] != path and not calls[0].exists()
    assert ctypes.CDLL(str(path)).answer() == 42
    assert list((tmp_path / "cache").iterdir()) == [path]


def test_a_failed_build_returns_its_last_line_and_leaves_nothing(tmp_path, cc):
    (tmp_path / "bad.c").write_text("this is not C\n")
    path = tmp_path / "cache" / "bad.so"
    error = build_once(path, lambda out: [cc, *FLAGS, str(tmp_path / "bad.c"), "-o", str(out)])
    assert error and "\n" not in error
    assert not list((tmp_path / "cache").iterdir())


def test_a_folder_that_cannot_be_made_is_an_error_not_an_exception(tmp_path, cc):
    (tmp_path / "cache").write_text("a file where the folder would go")
    error = build_once(tmp_path / "cache" / "a.so", lambda out: [cc, "-o", str(out)])
    assert error and "cache" in error


def test_processor_names_this_machine():
    assert processor() and processor() == processor()


def cpuinfo(tmp_path, name, model, flags):
    path = tmp_path / name
    path.write_text(f"processor\t: 0\nmodel name\t: {model}\nflags\t\t: {flags}\n\nprocessor\t: 1\n")
    return path


def test_one_model_name_with_other_instruction_sets_is_another_machine(tmp_path):
    avx512 = cpuinfo(tmp_path, "a", "Intel Xeon", "fpu sse2 avx2 avx512f amx_tile")
    masked = cpuinfo(tmp_path, "b", "Intel Xeon", "fpu sse2 avx2")
    reordered = cpuinfo(tmp_path, "c", "Intel Xeon", "amx_tile avx512f avx2 sse2 fpu")
    assert processor(avx512) != processor(masked) and processor(avx512) == processor(reordered)
    assert processor(avx512).startswith("Intel Xeon [")


def test_no_compiler_on_the_path_is_none_and_a_missing_cc_is_skipped(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("CC", "/nonexistent/cc")
    assert compiler() is None
    fake = tmp_path / "gcc"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    assert compiler() == str(fake)


def test_processes_building_one_file_at_once_build_it_once(tmp_path, cc):
    (tmp_path / "a.c").write_text(SOURCE)
    path, log = tmp_path / "cache" / "a.so", tmp_path / "builds.log"
    # Each process's build logs a line and takes long enough for the others to arrive meanwhile.
    script = f"echo built >> {log}; sleep 0.3; {cc} {' '.join(FLAGS)} {tmp_path / 'a.c'} -o OUT"
    builders = [subprocess.Popen([sys.executable, "-c", BUILD, str(path), script]) for _ in range(3)]
    assert [p.wait(timeout=60) for p in builders] == [0, 0, 0]
    assert log.read_text() == "built\n" and ctypes.CDLL(str(path)).answer() == 42
    assert [p.name for p in path.parent.iterdir()] == ["a.so"]


BUILD = """
import sys
from pathlib import Path
from titan.tools.native import build_once
assert build_once(Path(sys.argv[1]), lambda out: ["sh", "-c", sys.argv[2].replace("OUT", str(out))]) is None
"""
