"""The experiment: MotherNets, the independent baseline and Snapshot Ensembles, their seeds, snapshots, clusters
and budgets."""

import json
from dataclasses import dataclass

import pytest
import torch

from morphens import experiment, spec, train
from morphens.arch import forward_flops
from morphens.config import load_config
from morphens.experiment import independent, mothernets, prepare
from morphens.morph import hatch
from morphens.mother import mother_of
from morphens.train import eval_labels, steps_for


def tiny_mlp_ensemble(tmp_path, settings: dict[str, str]):
    """(config, data, members) of a quick local-engine MLP ensemble on digits; `settings` override the defaults."""
    defaults = {"data.dataset": "digits", "ensemble.family": "mlp", "training.batch_size": "64",
                "training.engine": "local", "mothernet.hatch_epochs": "0.1", "run.out": str(tmp_path)}
    cfg = load_config("", list({**defaults, **settings}.items()))
    data, members, _ = prepare(cfg)
    return cfg, data, members


@dataclass
class FitCall:
    net: object
    cfg: object
    epochs: float
    lr: float
    seed: int
    name: str
    fit: train.Fit


def spy_on_fits(monkeypatch) -> list[FitCall]:
    """Every experiment.fit call from now on, in order, with what it returned."""
    calls = []
    real_fit = experiment.fit

    def spy(net, data, run_cfg, epochs, lr, seed, name, solo=False):
        calls.append(FitCall(net, run_cfg, epochs, lr, seed, name, real_fit(net, data, run_cfg, epochs, lr, seed, name,
                                                                         solo)))
        return calls[-1].fit

    monkeypatch.setattr(experiment, "fit", spy)
    return calls


def test_hatched_members_reach_independent_accuracy_in_fewer_epochs(tmp_path):
    """Digits MLPs through the titan engine: members hatched from a (cheap, long-trained) mother and trained 2
    epochs match members trained 12 epochs from scratch; members trained 2 epochs from scratch are far worse."""
    overrides = {"data.dataset": "digits", "ensemble.family": "mlp", "ensemble.size": "3", "ensemble.width": "6",
                 "ensemble.width_ratio": "1.5", "ensemble.max_depth": "2", "training.batch_size": "64",
                 "training.epochs": "12", "mothernet.mother_epochs": "24", "mothernet.hatch_epochs": "2",
                 "run.out": str(tmp_path)}
    cfg = load_config("", list(overrides.items()))
    data, members, _ = prepare(cfg)
    labels = eval_labels(data)
    mean = lambda accs: sum(accs) / len(accs)
    from_scratch = mean([r.acc for r in independent(cfg, data, members, labels)])
    hatched = mean(mothernets(cfg, data, members, labels).member_acc)
    assert hatched >= from_scratch - 1.0
    cfg.training.epochs = 2
    assert mean([r.acc for r in independent(cfg, data, members, labels)]) < hatched - 5.0


def test_json_config_gives_the_same_members_as_toml(tmp_path):
    members = [{"family": "mlp", "hidden": [64, 32]}, {"family": "mlp", "hidden": [48]}]
    (tmp_path / "c.json").write_text(json.dumps({"data": {"dataset": "digits"}, "ensemble": {"members": members}}))
    cfg = load_config(str(tmp_path / "c.json"))
    _, parsed, sizes = prepare(cfg)
    assert [a.hidden for a in parsed] == [(64, 32), (48,)] and sizes == [2]


def test_snapshots_hatch_the_members_of_a_cluster_from_successive_warm_restarts(monkeypatch, tmp_path):
    """snapshots = 2: member j hatches from snapshot j % 2, two distinct mothers; the extra cycle is paid for."""
    cfg, data, members = tiny_mlp_ensemble(tmp_path, {"ensemble.size": "3", "mothernet.mother_epochs": "1",
                                                      "mothernet.noise": "0", "mothernet.snapshot_epochs": "1"})
    labels = eval_labels(data)
    single = mothernets(cfg, data, members, labels)
    hatched_from = []

    def spy(mother, *args, **kw):
        hatched_from.append(mother)
        return hatch(mother, *args, **kw)

    monkeypatch.setattr(experiment, "hatch", spy)
    cfg.mothernet.snapshots = 2
    out = mothernets(cfg, data, members, labels)
    first, second, third = hatched_from
    assert first is third and first is not second
    assert not torch.equal(first.state_dict()["head.weight"], second.state_dict()["head.weight"])
    assert len(out.mothers[0].snapshot_acc) == 2
    cycle = 3.0 * forward_flops(mother_of(members)) * steps_for(1, data, cfg) * cfg.training.batch_size
    assert out.train_cost == pytest.approx(single.train_cost + cycle)


def test_every_training_of_a_run_reads_the_data_in_its_own_order(monkeypatch, tmp_path):
    """12 snapshots: with seed offsets, cycle 10 used to repeat hatched member 0's order."""
    cfg, data, members = tiny_mlp_ensemble(tmp_path, {"ensemble.size": "12", "training.epochs": "0.1",
                                                      "mothernet.mother_epochs": "0.1", "mothernet.snapshots": "12",
                                                      "mothernet.snapshot_epochs": "0.1"})
    calls = spy_on_fits(monkeypatch)
    labels = eval_labels(data)
    independent(cfg, data, members, labels)
    mothernets(cfg, data, members, labels)
    seeds = [c.seed for c in calls]
    assert len(seeds) == 12 + 12 + 12 and len(set(seeds)) == len(seeds)


@pytest.mark.parametrize("engine", ["local", "titan"])
def test_bagging_trains_each_hatched_member_on_its_own_resample(monkeypatch, tmp_path, engine):
    """mothernet.bagging: the hatched members draw distinct bootstrap resamples; the mother keeps the subset."""
    cfg, data, members = tiny_mlp_ensemble(tmp_path, {"ensemble.size": "3", "mothernet.mother_epochs": "0.1",
                                                      "mothernet.bagging": "true", "training.engine": engine})
    resamples = {}
    module = train if engine == "local" else spec
    real_loader = module.Loader

    def spy(*args, bootstrap=0, **kw):
        loader = real_loader(*args, bootstrap=bootstrap, **kw)
        if loader.train:
            resamples.setdefault(bootstrap, loader.y)
        return loader

    monkeypatch.setattr(module, "Loader", spy)
    mothernets(cfg, data, members, eval_labels(data))
    assert 0 in resamples and len(resamples) == 1 + 3  # the mother's subset, then one resample per member
    assert len({tuple(y.tolist()) for y in resamples.values()}) == 4


def test_each_cluster_has_its_own_mother_and_snapshots(monkeypatch, tmp_path):
    """g = 2, snapshots = 2, four members: four distinct snapshot mothers, two per cluster, one per member pair."""
    cfg, data, members = tiny_mlp_ensemble(tmp_path, {"ensemble.size": "4", "mothernet.mother_epochs": "0.2",
                                                      "mothernet.snapshot_epochs": "0.2", "mothernet.clusters": "2",
                                                      "mothernet.snapshots": "2"})
    hatched_from = {}

    def spy(mother, member, **kw):
        hatched_from[members.index(member)] = mother
        return hatch(mother, member, **kw)

    monkeypatch.setattr(experiment, "hatch", spy)
    out = mothernets(cfg, data, members, eval_labels(data))
    assert [len(m.snapshot_acc) for m in out.mothers] == [2, 2]
    assert len({id(m) for m in hatched_from.values()}) == 4
    for mother in out.mothers:
        first, second = (hatched_from[i] for i in mother.members)
        assert first.arch == mother_of([members[i] for i in mother.members]) == second.arch




def test_mothers_and_hatched_members_train_with_their_own_batch_size_and_lr(monkeypatch, tmp_path):
    """mothernet.batch_size 128 and lr_factor 2: mother and snapshot at batch 128 and 2x lr; hatch_batch_size 32:
    hatched members at batch 32 and training.lr x hatch_lr_factor.
    The record's `time` holds the wall and CPU seconds of each part, and wall_s / cpu_s are their sums."""
    cfg, data, members = tiny_mlp_ensemble(tmp_path, {"ensemble.size": "2", "mothernet.mother_epochs": "0.1",
                                                      "mothernet.snapshots": "2", "mothernet.snapshot_epochs": "0.1",
                                                      "mothernet.batch_size": "128", "mothernet.lr_factor": "2",
                                                      "mothernet.hatch_batch_size": "32"})
    calls = spy_on_fits(monkeypatch)
    out = mothernets(cfg, data, members, eval_labels(data))
    seen = {c.name.split("-")[0] + ("-snapshot" if "snapshot" in c.name else ""): (c.cfg.training.batch_size, c.lr)
            for c in calls}
    fits = {c.name: c.fit for c in calls}
    lr = cfg.training.lr
    assert seen == {"mother": (128, 2 * lr), "mother-snapshot": (128, 2 * lr), "hatched": (32, lr * 1.0)}
    split = out.time
    assert split.mothers == fits["mother-0-of-2"].time
    assert split.snapshots == fits["mother-0-of-2-snapshot-1"].time
    assert split.members.wall == pytest.approx(sum(f.time.wall for n, f in fits.items() if n.startswith("hatched")))
    assert split.hatch.wall > 0 and split.hatch.cpu > 0
    parts = [split.mothers, split.snapshots, split.hatch, split.members]
    assert out.wall_s == pytest.approx(sum(p.wall for p in parts))
    assert out.cpu_s == pytest.approx(sum(p.cpu for p in parts))



def test_snapshot_ensemble_averages_the_last_k_end_points_of_one_chain_of_warm_restarts(monkeypatch, tmp_path):
    """snapshot.cycles 4 at K = 3: one net (the median member by FLOPs) through four cycles at the chain's own batch
    and lr, each from the last one's end point; the last three end points are the ensemble, all four are paid for."""
    cfg, data, members = tiny_mlp_ensemble(tmp_path, {"ensemble.size": "3", "snapshot.cycles": "4",
                                                      "snapshot.cycle_epochs": "0.2", "snapshot.batch_size": "32",
                                                      "snapshot.lr_factor": "0.5"})
    fits = spy_on_fits(monkeypatch)
    labels = eval_labels(data)
    out = experiment.snapshot_ensemble(cfg, data, members, labels)
    arch = sorted(members, key=forward_flops)[1]
    assert [f.net.arch for f in fits] == [arch] * 4
    assert all(later.net is earlier.fit.net for earlier, later in zip(fits, fits[1:]))
    assert {(f.cfg.training.batch_size, f.epochs, f.lr) for f in fits} == {(32, 0.2, 0.5 * cfg.training.lr)}
    last = [train.accuracy(train.predict(f.fit.net, data), labels) for f in fits[1:]]
    assert out.method == "snapshot" and out.ensemble_size == 3 and out.member_acc == last
    probs = torch.stack([train.predict(f.fit.net, data) for f in fits[1:]]).mean(0)
    assert out.ensemble_acc == train.accuracy(probs, labels)
    assert out.train_cost == pytest.approx(sum(f.fit.flops for f in fits))
    assert out.wall_s == pytest.approx(sum(f.fit.time.wall for f in fits))


def test_budgets_scale_every_methods_epochs_and_each_method_gets_its_speedup(monkeypatch, tmp_path):
    """run.budgets 0.5, 1: every fit of budget 0.5 (mother, cycle, two hatched, two independent, two snapshots) runs
    half the epochs of its budget-1 twin; each record carries
    its budget and the device that ran it, and the methods beside the baseline its cost and time ratios."""
    cfg, data, members = tiny_mlp_ensemble(tmp_path, {"ensemble.size": "2", "training.epochs": "0.4",
                                                      "mothernet.mother_epochs": "0.4", "mothernet.snapshots": "2",
                                                      "mothernet.snapshot_epochs": "0.2", "run.budgets": "0.5,1",
                                                      "snapshot.cycle_epochs": "0.2",
                                                      "run.methods": "mothernets,independent,snapshot"})
    calls = spy_on_fits(monkeypatch)
    reported = []
    results = experiment.experiment(cfg, data, members, [2], done=lambda so_far: reported.append(len(so_far)))
    assert reported == [3, 6]  # the report is rewritten after each budget's size
    assert [(r.method, r.budget) for r in results] == [(m, b) for b in (0.5, 1.0)
                                                       for m in ("mothernets", "independent", "snapshot")]
    epochs = {}
    for c in calls:
        epochs.setdefault(c.name, []).append(c.epochs)
    assert len(epochs) == 2 + 2 + 2 + 2 and all(e[0] == pytest.approx(e[1] / 2) for e in epochs.values())
    for r in results:
        assert r.device == "cpu"
        base = next(b for b in results if b.method == "independent" and b.budget == r.budget)
        if r is base:
            assert r.speedup is None
        else:
            assert r.speedup.cost == pytest.approx(base.train_cost / r.train_cost)
            assert r.speedup.wall == pytest.approx(base.wall_s / r.wall_s)


def test_matched_snapshot_scales_the_chains_cycles_to_mothernets_time(monkeypatch, tmp_path):
    """matched_snapshot after mothernets and snapshot: the same net through as many cycles, each cycle_epochs x
    MotherNets' wall seconds over the snapshot chain's; its record names it and its cycle length."""
    cfg, data, members = tiny_mlp_ensemble(tmp_path, {"ensemble.size": "2", "mothernet.mother_epochs": "0.4",
                                                      "snapshot.cycle_epochs": "0.3",
                                                      "run.methods": "mothernets,snapshot,matched_snapshot"})
    calls = spy_on_fits(monkeypatch)
    mn, snap, matched = experiment.experiment(cfg, data, members, [2])
    chains = {m: [c for c in calls if c.name.startswith(f"{m}-")] for m in ("snapshot", "matched_snapshot")}
    scaled = 0.3 * mn.wall_s / snap.wall_s
    assert [c.net.arch for c in chains["matched_snapshot"]] == [c.net.arch for c in chains["snapshot"]]
    assert [c.epochs for c in chains["matched_snapshot"]] == pytest.approx([scaled, scaled])
    assert (snap.method, snap.cycle_epochs) == ("snapshot", 0.3)
    assert (matched.method, matched.cycle_epochs) == ("matched_snapshot", pytest.approx(scaled))
    assert matched.wall_s == pytest.approx(sum(c.fit.time.wall for c in chains["matched_snapshot"]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_local_engine_trains_and_evaluates_on_cuda_as_on_the_cpu(tmp_path):
    """training.device cuda: the record names the GPU; the nets match the CPU's to within float rounding."""
    on = {}
    for device in ("cpu", "cuda"):
        cfg, data, members = tiny_mlp_ensemble(tmp_path, {"ensemble.size": "2", "training.epochs": "0.5",
                                                          "run.methods": "independent", "training.device": device})
        on[device] = experiment.experiment(cfg, data, members, [2])[0]
    assert on["cuda"].device.startswith("cuda") and on["cpu"].device == "cpu"
    assert on["cuda"].member_acc == pytest.approx(on["cpu"].member_acc, abs=1.0)
