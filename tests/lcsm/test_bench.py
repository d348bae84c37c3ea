import json

import pytest

from lcsm.bench import main


def test_bench_writes_records_and_plot(tmp_path, capsys):
    argv = ["--lengths", "64", "128", "--methods", "lazy", "eager", "recompute", "flash", "flash_unbatched",
            "flash_fft", "--channels", "4", "--layers", "2", "--e2e-max-len", "64", "--out", str(tmp_path)]
    assert main(argv) == 0
    records = json.loads((tmp_path / "results.json").read_text())
    assert (tmp_path / "results.png").stat().st_size > 0
    keys = {"method", "seq_len", "batch", "channels", "layers", "mixer_s", "total_s", "max_abs_err"}
    assert all(keys <= r.keys() for r in records)
    assert {(r["part"], r["seq_len"]) for r in records} == {("mixer", 64), ("mixer", 128), ("e2e", 64)}
    assert max(r["max_abs_err"] for r in records) < 1e-4
    e2e = [r for r in records if r["part"] == "e2e"]
    assert {r["method"] for r in e2e} == {"lazy", "eager", "recompute", "flash", "flash_unbatched", "flash_fft"}
    assert all(0 < r["mixer_s"] < r["total_s"] for r in e2e)
    out = capsys.readouterr().out
    assert "flash" in out and "faster than lazy" in out and "tau batched over layers" in out


@pytest.mark.parametrize("argv,message", [(["--methods", "quick"], "unknown method 'quick'"),
                                          (["--lengths", "1"], "--lengths must be >= 2"),
                                          (["--parts", "all"], "--parts must be mixer and/or e2e"),
                                          (["--threads", "0"], ">= 1"),
                                          (["--device", "gpu"], "--device 'gpu' is not a torch device")])
def test_bench_user_mistakes_exit_2(tmp_path, capsys, argv, message):
    assert main([*argv, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0]
    assert not (tmp_path / "results.json").exists()


def test_an_unwritable_out_folder_stops_the_bench_before_it_runs(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert main(["--quick", "--out", str(blocker / "sub")]) == 2
    captured = capsys.readouterr()
    assert captured.err.strip().splitlines() == [f"error: --out {blocker / 'sub'} cannot be written ({blocker} is not "
                                                 "a writable folder); give another folder"]
    assert "lcsm.bench on" not in captured.out  # nothing was benchmarked
