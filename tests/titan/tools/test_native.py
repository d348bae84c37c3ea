"""Building C code once: the file appears whole or not at all, a second call builds nothing, and a failure is
returned as its last line, with nothing left behind."""

import ctypes

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
