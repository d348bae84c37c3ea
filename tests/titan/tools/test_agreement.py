"""built_once: ranks sharing a cache folder build the file once (under a lock) and all read it whole; a failure on
one rank, in the build or in the folder, is raised on every rank with the same line (none waits in a barrier)."""

from tests.launch import run_ranks

MODULE = "tests.titan.tools.agreement_ranks"


def run(tmp_path, scenario):
    return run_ranks(MODULE, [scenario, str(tmp_path)], tmp_path / "out")


def test_two_ranks_sharing_a_folder_build_once_and_both_read_it(tmp_path):
    assert run(tmp_path, "shared") == [{"content": "built"}, {"content": "built"}]
    assert len((tmp_path / "builds.log").read_text().split()) == 1
    assert [p.name for p in (tmp_path / "cache").iterdir()] == ["tokens.npy"]


def test_a_build_that_fails_on_one_rank_fails_on_every_rank(tmp_path):
    ranks = run(tmp_path, "build_fails")
    assert ranks[0] == ranks[1] == {"error": "the corpus has no documents"}
    assert sorted((tmp_path / "builds.log").read_text().split()) == ["0", "1"]  # each node built its own


def test_a_folder_one_rank_cannot_write_fails_on_every_rank(tmp_path):
    ranks = run(tmp_path, "unwritable")
    assert ranks[0] == ranks[1]
    assert ranks[0]["error"].startswith("cannot write the cache file tokens.npy (")
    assert ranks[0]["error"].endswith("set TITAN_CACHE_DIR to a writable folder")
