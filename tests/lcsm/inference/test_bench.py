import gc
import json

import matplotlib.image
import pytest
import torch

from lcsm.inference.accel import native
from lcsm.inference.bench import gc_paused, main


def test_bench_writes_records_and_plot(tmp_path, capsys):
    argv = ["--lengths", "32", "64", "--methods", "lazy", "eager", "recompute", "flash", "flash_batched",
            "flash_unbatched", "flash_fft", "--channels", "4", "--layers", "2", "--e2e-max-len", "32", "--batch", "1",
            "3", "--decode", "eager", "--block", "16", "--out", str(tmp_path)]
    assert main(argv) == 0
    records = json.loads((tmp_path / "results.json").read_text())
    png = matplotlib.image.imread(tmp_path / "results.png")
    assert png.shape[1] == round(4 * 5.5 * 110)  # one panel per part and batch, 5.5 inches at 110 dpi each
    keys = {"method", "seq_len", "batch", "channels", "layers", "mixer_s", "total_s", "max_abs_err"}
    assert all(keys <= r.keys() for r in records)
    assert {(r["part"], r["seq_len"], r["batch"]) for r in records} == {
        (part, L, B) for part, L in [("mixer", 32), ("mixer", 64), ("e2e", 32)] for B in (1, 3)}
    assert max(r["max_abs_err"] for r in records) < 1e-4
    e2e = [r for r in records if r["part"] == "e2e"]
    assert {r["method"] for r in e2e} == {"lazy", "eager", "recompute", "flash", "flash_batched", "flash_unbatched",
                                          "flash_fft"}
    assert all(0 < r["mixer_s"] < r["total_s"] for r in e2e)
    flash = [r for r in records if r["method"] == "flash"]
    assert all(list(r["tiles"]) == (["16"] if r["seq_len"] == 32 else ["16", "32"]) for r in flash)
    assert all(r["block"] == 16 and r["step"] == ("C" if native.compiler() else "tensor ops") for r in flash)
    out = capsys.readouterr().out
    lazy, fast = (next(r for r in e2e if r["method"] == m and r["batch"] == 3) for m in ("lazy", "flash"))
    assert f"e2e L=32 B=3: flash {lazy['total_s'] / fast['total_s']:.1f}x faster than lazy" in out
    batched, unbatched = (next(r for r in e2e if r["method"] == m and r["batch"] == 3)
                          for m in ("flash_batched", "flash_unbatched"))
    assert (f"e2e L=32 B=3: tiles batched over slots {unbatched['mixer_s'] / batched['mixer_s']:.2f}x faster "
            "(mixer time) than per-slot tiles") in out
    assert "tiles of e2e flash B=3 L=32 (block 16, step: C): 16: " in out


def test_e2e_with_the_token_in_one_c_call_still_splits_the_mixer_time(tmp_path):
    if not native.available(torch.device("cpu"), torch.float32):
        pytest.skip("no C compiler here")
    argv = ["--parts", "e2e", "--lengths", "64", "--methods", "lazy", "flash", "--channels", "4", "--layers", "2",
            "--batch", "1", "--decode", "native", "--block", "8", "--out", str(tmp_path)]
    assert main(argv) == 0
    records = json.loads((tmp_path / "results.json").read_text())
    assert {r["method"] for r in records} == {"lazy", "flash"}
    assert all(0 < r["mixer_s"] < r["total_s"] and r["max_abs_err"] < 1e-4 for r in records)


@pytest.mark.parametrize("argv,message", [(["--methods", "quick"], "unknown method 'quick'"),
                                          (["--lengths", "1"], "--lengths must be >= 2"),
                                          (["--parts", "all"], "--parts must be mixer and/or e2e"),
                                          (["--threads", "0"], ">= 1"),
                                          (["--block", "48"], "--block must be a power of two >= 1, got 48"),
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


def test_a_decode_step_that_cannot_be_compiled_names_the_eager_fallback(tmp_path, capsys, monkeypatch):
    def no_compiler(*args, **kwargs):
        raise RuntimeError("Compiler: cc is not found.")

    monkeypatch.setattr("torch._inductor.aoti_compile_and_package", no_compiler)
    argv = ["--parts", "e2e", "--lengths", "32", "--methods", "lazy", "--channels", "4", "--layers", "1", "--batch",
            "5", "--decode", "compiled", "--out", str(tmp_path)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: compiling the decode step failed (RuntimeError: Compiler: cc is not found.)")
    assert err[-1].endswith("(decode='eager' or 'native', or --decode eager|native)")


def test_timed_loops_pause_the_garbage_collector_and_leave_it_as_it_was():
    assert gc.isenabled()
    with pytest.raises(RuntimeError), gc_paused():
        assert not gc.isenabled()
        raise RuntimeError("a step failed")
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_bench_model_runs_hyenadna_and_extrapolates_lazy(tmp_path, capsys):
    """--model: a published HyenaDNA configuration with random weights; lazy runs at the two shortest lengths
    whatever the budget, and beyond the budget its time per token is a + b L through them, marked."""
    argv = ["--model", "hyenadna-tiny-1k", "--lengths", "32", "64", "128", "--budget", "0", "--out", str(tmp_path)]
    assert main(argv) == 0
    records = json.loads((tmp_path / "results.json").read_text())
    lazy = {r["seq_len"]: r for r in records if r["method"] == "lazy"}
    flash = {r["seq_len"]: r for r in records if r["method"] == "flash"}
    assert sorted(flash) == sorted(lazy) == [32, 64, 128]
    assert not lazy[32]["extrapolated"] and not lazy[64]["extrapolated"] and lazy[128]["extrapolated"]
    slope = (lazy[64]["us_per_token"] - lazy[32]["us_per_token"]) / 32
    assert lazy[128]["us_per_token"] == pytest.approx(lazy[64]["us_per_token"] + 64 * slope)
    assert lazy[128]["max_abs_err"] is None
    assert all(r["max_abs_err"] < 1e-4 and r["tokens_per_s"] > 0 and r["model"] == "hyenadna-tiny-1k"
               for r in flash.values())
    out = capsys.readouterr().out
    assert "* extrapolated from lazy's measured time per token" in out
    assert f"{128:7d} {flash[128]['us_per_token']:12.0f}" in out
