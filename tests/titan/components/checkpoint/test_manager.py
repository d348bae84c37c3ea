import torch

from titan.components.checkpoint.manager import CheckpointManager
from titan.config import JobConfig


def trained_linear(out_features: int = 3):
    model = torch.nn.Linear(4, out_features)
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    return model, optimizer, scheduler


def async_manager(folder, reuse: bool) -> CheckpointManager:
    config = JobConfig().checkpoint
    config.enable, config.async_mode, config.reuse_staging_buffer = True, "async", reuse
    return CheckpointManager(folder, config, {"model": "linear"})


def test_async_saves_reuse_one_staging_buffer_and_each_checkpoint_keeps_its_own_values(tmp_path):
    model, optimizer, scheduler = trained_linear()
    manager = async_manager(tmp_path, reuse=True)
    saved = []
    for step in (1, 2):
        with torch.no_grad():
            model.weight.fill_(float(step))
        saved.append(model.weight.clone())
        manager.save(step, [model], [optimizer], [scheduler], {"step": step})
        if step == 1:
            buffer = manager._stager.state_dict_cache["model"]["weight"]
    manager.wait()
    assert manager._stager.state_dict_cache["model"]["weight"] is buffer
    for step, weight in zip((1, 2), saved):
        manager.load(step, [model], [optimizer], [scheduler], {"step": 0})
        assert torch.equal(model.weight, weight)


def test_a_new_state_layout_gets_a_new_staging_buffer(tmp_path):
    model, optimizer, scheduler = trained_linear()
    manager = async_manager(tmp_path, reuse=True)
    manager.save(1, [model], [optimizer], [scheduler], {"step": 1})
    first = manager._stager.state_dict_cache
    wider, wider_optimizer, wider_scheduler = trained_linear(out_features=5)
    manager.save(2, [wider], [wider_optimizer], [wider_scheduler], {"step": 2})
    manager.wait()
    assert manager._stager.state_dict_cache is not first
    assert manager._stager.state_dict_cache["model"]["weight"].shape == (5, 4)


def test_without_reuse_every_save_stages_a_fresh_copy(tmp_path):
    model, optimizer, scheduler = trained_linear()
    manager = async_manager(tmp_path, reuse=False)
    manager.save(1, [model], [optimizer], [scheduler], {"step": 1})
    manager.wait()
    assert manager._stager is None
    manager.load(1, [model], [optimizer], [scheduler], {"step": 0})



def _checkpointed_first_layer(model: torch.nn.Sequential) -> torch.nn.Sequential:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model[0] = checkpoint_wrapper(model[0])
    return model


def test_full_state_dicts_round_trip_through_plain_and_wrapped_modules(monkeypatch):
    """A plain module loads and gives its full state dict without DCP's name mapping, and so does an
    activation-checkpointed one (its wrapper's hooks hide the wrapper's name); a compiled one (names under
    `_orig_mod.`) still goes through DCP. All take and give the model's own names."""
    from titan.components.checkpoint import manager

    calls = []
    for name in ("set_model_state_dict", "get_model_state_dict"):
        real = getattr(manager, name)
        monkeypatch.setattr(manager, name, lambda *a, real=real, name=name, **kw: calls.append(name) or real(*a, **kw))
    full = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4)).state_dict()
    for wrap, through_dcp in ((lambda m: m, False), (torch.compile, True), (_checkpointed_first_layer, False)):
        calls.clear()
        model = wrap(torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4)))
        manager.load_full_model_state_dict(model, dict(full))  # DCP renames the keys of the dict it is given
        got = manager.full_model_state_dict(model)
        assert calls == (["set_model_state_dict", "get_model_state_dict"] if through_dcp else [])
        assert got.keys() == full.keys() and all(torch.equal(got[k], full[k]) for k in full)
