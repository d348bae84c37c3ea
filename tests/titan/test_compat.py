"""The version shims: torch_at_least compares release numbers, set_group_timeout finds the setter torch has."""

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from titan.compat import set_group_timeout, tomllib, torch_at_least


@pytest.mark.parametrize("version, answer", [("2.12", True), ("2.12.1", True), ("2.12.2", False), ("2.13", False),
                                             ("2.9", True), ("3.0", False)])
def test_torch_at_least_ignores_the_local_tag_and_compares_numbers(monkeypatch, version, answer):
    monkeypatch.setattr(torch, "__version__", "2.12.1+cu130")
    assert torch_at_least(version) is answer


@pytest.mark.parametrize("public", [True, False], ids=["dist.set_timeout", "private setter"])
def test_set_group_timeout_calls_the_setter_this_torch_has(monkeypatch, public):
    calls = []
    if public:
        monkeypatch.setattr(dist, "set_timeout", lambda *a: calls.append(a), raising=False)
    else:
        monkeypatch.delattr(dist, "set_timeout", raising=False)
        monkeypatch.setattr(c10d, "_set_pg_timeout", lambda *a: calls.append(a))
    set_group_timeout(timedelta(seconds=7), "group")
    assert calls == [(timedelta(seconds=7), "group")]


def test_tomllib_parses_toml():
    assert tomllib.loads('[training]\nsteps = 3\n') == {"training": {"steps": 3}}
