"""built_once: ranks sharing a cache folder build the file once (under a lock) and all read it whole; a failure on
one rank, in the build or in the folder, is raised on every rank with the same line (none waits in a barrier)."""

import json
import os

from tests.launch import run_module

MODULE = "tests.titan.tools.agreement_ranks"


def run_ranks(tmp_path, scenario):
    out = tmp_path / "out"
    out.mkdir()
    proc = run_module(MODULE, [scenario, str(tmp_path), str(out)], os.environ | {"OMP_NUM_THREADS": "1"}, nproc=2,
                      timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_two_ranks_sharing_a_folder_build_once_and_both_read_it(tmp_path):
    assert run_ranks(tmp_path, "shared") == [{"content": "built"}, {"content": "built"}]
    assert len((tmp_path / "builds.log").read_text().split()) == 1
    assert [p.name for p in (tmp_path / "cache").iterdir()] == ["tokens.npy"]


def test_a_build_that_fails_on_one_rank_fails_on_every_rank(tmp_path):
    ranks = run_ranks(tmp_path, "build_fails")
    assert ranks[0] == ranks[1] == {"error": "the corpus has no documents"}
    assert sorted((tmp_path / "builds.log").read_text().split()) == ["0", "1"]  # each node built its own


def test_a_folder_one_rank_cannot_write_fails_on_every_rank(tmp_path):
    ranks = run_ranks(tmp_path, "unwritable")
    assert ranks[0] == ranks[1]
    assert ranks[0]["error"].startswith("cannot write the cache file tokens.npy (")
    assert ranks[0]["error"].endswith("set TITAN_CACHE_DIR to a writable folder")
