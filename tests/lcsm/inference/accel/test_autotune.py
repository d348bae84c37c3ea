import json

import torch

from lcsm.inference.accel import autotune


def test_choice_is_timed_once_then_read_from_disk(tmp_path, monkeypatch):
    monkeypatch.setenv("LCSM_CACHE_DIR", str(tmp_path))
    autotune.forget()
    calls = {"slow": 0, "fast": 0}

    def slow():
        calls["slow"] += 1
        sum(range(20000))

    def fast():
        calls["fast"] += 1

    cpu = torch.device("cpu")
    assert autotune.choose(cpu, "shape A", {"slow": slow, "fast": fast}) == "fast"
    saved = json.loads((tmp_path / "autotune.json").read_text())
    assert saved == {autotune.machine(cpu): {"shape A": "fast"}}
    autotune.forget()  # a new process: the choice comes from the file, nothing is timed
    timed = dict(calls)
    assert autotune.choose(cpu, "shape A", {"slow": slow, "fast": fast}) == "fast"
    assert calls == timed
    autotune.forget()


def test_unreadable_cache_only_costs_the_timing(tmp_path, monkeypatch):
    monkeypatch.setenv("LCSM_CACHE_DIR", str(tmp_path))
    (tmp_path / "autotune.json").write_text("{not json")
    autotune.forget()
    assert autotune.choose(torch.device("cpu"), "k", {"only": lambda: None}) == "only"
    assert json.loads((tmp_path / "autotune.json").read_text())[autotune.machine(torch.device("cpu"))] == {"k": "only"}
    autotune.forget()


def test_machine_names_processor_torch_and_threads():
    name = autotune.machine(torch.device("cpu"))
    assert torch.__version__ in name and f"{torch.get_num_threads()} threads" in name
