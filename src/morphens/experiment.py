"""The experiment: MotherNets (cluster, train one mother per cluster, hatch and briefly train each member), the
independent baseline (every member from scratch) and Snapshot Ensembles (one net through warm-restart cycles) at
each ensemble size and training budget of a sweep, measured side by side."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from morphens.arch import Arch, arch_from_dict, arch_to_dict, describe, forward_flops
from morphens.config import RunConfig
from morphens.data import Dataset, Loader, derived_seed, load
from morphens.models import Net, num_params
from morphens.morph import hatch
from morphens.mother import cluster, mother_of
from morphens.records import MethodResult, Mother, NetScore, Seconds, Speedup, TimeSplit
from morphens.spread import gather_group, gathered, my_nets, owners, shared_nets, spreading
from morphens.train import Fit, accuracy, ensemble_accuracy, eval_labels, fit, predict, seeded
from titan.components.metrics.throughput import cpu_peak_tflops
from titan.distributed.runtime import init_distributed
from titan.tools.cli import check_writable

INDEPENDENT, MOTHER, SNAPSHOT, HATCHED, BAGGED, SNAPSHOT_ENSEMBLE = range(6)
"""Roles in the seeds of a run's data orders and resamples: `derived_seed(training.seed, role, *indices)`."""


def members_of(cfg: RunConfig, data: Dataset) -> list[Arch]:
    e = cfg.ensemble
    if e.members:
        return [arch_from_dict(m, data.in_shape, data.num_classes) for m in e.members]
    return e.generator().sample(max(cfg.run.sizes or [e.size]), data.in_shape, data.num_classes, e.seed)


def log(msg: str) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        print(msg, flush=True)


def total(seconds: list[Seconds]) -> Seconds:
    return sum(seconds, Seconds())


def scratch(cfg: RunConfig, data: Dataset, arch: Arch, i: int, solo: bool = False) -> Fit:
    """Member i trained from scratch for training.epochs (its seeds depend only on i)."""
    t = cfg.training
    return fit(seeded(arch, t.seed * 1000 + i), data, cfg, t.epochs, t.lr, derived_seed(t.seed, INDEPENDENT, i),
               f"independent-{i}", solo)


def scored(cfg: RunConfig, data: Dataset, run: Fit, labels: torch.Tensor, param_epochs: float) -> NetScore:
    probs = predict(run.net, data, cfg.data.test_limit, cfg.training.torch_device())
    return NetScore(probs, accuracy(probs, labels), run.time, run.flops, param_epochs)


def result(method: str, cfg: RunConfig, scores: list[NetScore], labels: torch.Tensor, split: TimeSplit,
           archs: list[Arch], extra_flops: float = 0.0, extra_param_epochs: float = 0.0, **fields) -> MethodResult:
    """The ensemble of these nets' scores as `method`'s record; `extra_*` is the cost of nets outside it."""
    return MethodResult(method, len(scores), str(cfg.training.torch_device()),
                        ensemble_accuracy([s.probs for s in scores], labels), [s.acc for s in scores],
                        extra_flops + sum(s.flops for s in scores),
                        extra_param_epochs + sum(s.param_epochs for s in scores), split,
                        members=[arch_to_dict(a) for a in archs], **fields)


def independent(cfg: RunConfig, data: Dataset, members: list[Arch], labels: torch.Tensor,
                first: int = 0) -> list[NetScore]:
    """Members first, first + 1, ... from scratch (spread over the ranks with `training.spread members`); one score
    per member trained."""
    mine = {}
    for j in my_nets(cfg, [forward_flops(a) for a in members[first:]]):
        i = first + j
        mine[i] = scored(cfg, data, scratch(cfg, data, members[i], i, spreading(cfg)), labels,
                         num_params(members[i]) * cfg.training.epochs)
    out = gathered(cfg, mine)
    for i, r in enumerate(out, first):
        log(f"  independent {i}: {describe(members[i])} acc {r.acc:.2f}% in {r.seconds.wall:.1f}s")
    return out


def at_batch(cfg: RunConfig, batch_size: int) -> RunConfig:
    """`cfg` training at `batch_size` (0 = training.batch_size)."""
    return replace(cfg, training=replace(cfg.training, batch_size=batch_size or cfg.training.batch_size))


def budgeted(cfg: RunConfig, budget: float) -> RunConfig:
    """`cfg` with every epoch count of every method scaled by `budget` (run.budgets)."""
    m, s = cfg.mothernet, cfg.snapshot
    return replace(cfg, training=replace(cfg.training, epochs=cfg.training.epochs * budget),
                   mothernet=replace(m, mother_epochs=m.mother_epochs * budget,
                                     snapshot_epochs=m.snapshot_epochs * budget, hatch_epochs=m.hatch_epochs * budget),
                   snapshot=replace(s, cycle_epochs=s.cycle_epochs * budget))


def warm_restarts(net: Net, data: Dataset, cfg: RunConfig, epochs: list[float], lr: float, seeds: list[int],
                  names: list[str], solo: bool) -> list[Fit]:
    """Trains `net` for epochs[0], then each further cycle from the last one's end point (a warm restart: warmup to
    the peak lr again, cosine to zero): one Fit per cycle."""
    runs: list[Fit] = []
    for e, seed, name in zip(epochs, seeds, names):
        runs.append(fit(runs[-1].net if runs else net, data, cfg, e, lr, seed, name, solo))
    return runs


def chain_epochs(cfg: RunConfig, count: int) -> float:
    """Epochs of a mother and its `count - 1` warm-restart cycles."""
    return cfg.mothernet.mother_epochs + (count - 1) * cfg.mothernet.snapshot_epochs


@dataclass
class Chain:
    """A mother's training and its warm-restart cycles: each end point's accuracy, the cost, the two times."""

    acc: list[float]
    flops: float
    param_epochs: float
    first: Seconds
    cycles: Seconds


def mother_chain(cfg: RunConfig, data: Dataset, arch: Arch, c: int, name: str, labels: torch.Tensor,
                 count: int) -> tuple[list[Net], Chain]:
    """Cluster c's mother and its `count - 1` warm-restart cycles, trained on this rank alone where members are
    spread: the nets (each cycle's end point) and their record."""
    m, t = cfg.mothernet, cfg.training
    epochs = [m.mother_epochs] + [m.snapshot_epochs] * (count - 1)
    seeds = [derived_seed(t.seed, MOTHER, c)] + [derived_seed(t.seed, SNAPSHOT, c, s) for s in range(1, count)]
    names = [name] + [f"{name}-snapshot-{s}" for s in range(1, count)]
    runs = warm_restarts(seeded(arch, 10**6 + t.seed * 1000 + c), data, at_batch(cfg, m.batch_size), epochs,
                         t.lr * m.lr_factor, seeds, names, spreading(cfg))
    device = t.torch_device()
    return [r.net for r in runs], Chain(
        [accuracy(predict(r.net, data, cfg.data.test_limit, device), labels) for r in runs],
        sum(r.flops for r in runs), num_params(arch) * chain_epochs(cfg, count), runs[0].time,
        total([r.time for r in runs[1:]]))


def train_mothers(cfg: RunConfig, data: Dataset, members: list[Arch], labels: torch.Tensor,
                  groups: list[list[int]]) -> tuple[dict[int, Net], list[Mother], list[Chain]]:
    """One mother per cluster of more than one member, then its warm-restart cycles (`mothernet.snapshots`), the
    mothers spread over the ranks like members; returns (member index -> the snapshot it hatches from, every
    cluster's mother, the chains trained)."""
    m = cfg.mothernet
    archs = [mother_of([members[i] for i in idx]) for idx in groups]
    mothers = [Mother(describe(a), idx) for a, idx in zip(archs, groups)]
    chains = [(c, min(m.snapshots, len(idx))) for c, idx in enumerate(groups) if len(idx) > 1]
    costs = [forward_flops(archs[c]) * chain_epochs(cfg, count) for c, count in chains]
    mine, records = {}, {}
    for j in my_nets(cfg, costs):
        c, count = chains[j]
        mine[j], records[j] = mother_chain(cfg, data, archs[c], c, f"mother-{c}-of-{len(members)}", labels, count)
    nets = shared_nets(cfg, mine, [(archs[c], count) for c, count in chains], owners(cfg, costs))
    trained, done = {}, gathered(cfg, records)
    for (c, count), runs, record in zip(chains, nets, done):
        idx = groups[c]
        trained.update({i: runs[j % count] for j, i in enumerate(idx)})
        mothers[c].snapshot_acc = record.acc
        log(f"  mother {c} {describe(archs[c])} for members {idx}: acc " + ", ".join(f"{a:.2f}%" for a in record.acc))
    return trained, mothers, done


def mothernets(cfg: RunConfig, data: Dataset, members: list[Arch], labels: torch.Tensor) -> MethodResult:
    """Clusters the members and trains one mother per cluster (with `mothernet.snapshots` > 1, followed by
    warm-restart cycles whose end points the cluster's members hatch from in turn), then hatches and trains every
    member (mothers and members spread over the ranks with `training.spread members`); a member alone in its
    cluster is its own mother and trains as it would independently. Times count training and hatching, not
    evaluation, as for the independent members; `time` splits them into the mothers' first training, their
    snapshot cycles, hatching and the members' training."""
    m, t = cfg.mothernet, cfg.training
    calib = next(iter(Loader(data, m.calib_batch, augmented=False, limit=cfg.data.train_limit)))[0]
    groups = cluster(members, m.clusters_for(len(members)))
    log(f"  g={len(groups)}")
    trained, mothers, chains = train_mothers(cfg, data, members, labels, groups)
    hcfg, mine = at_batch(cfg, m.hatch_batch_size), {}
    epochs = [m.hatch_epochs if i in trained else t.epochs for i in range(len(members))]
    for i in my_nets(cfg, [forward_flops(a) * e for a, e in zip(members, epochs)]):
        if i not in trained:
            mine[i] = scored(cfg, data, scratch(cfg, data, members[i], i, spreading(cfg)), labels,
                             num_params(members[i]) * t.epochs)
            continue
        start, cpu_start = time.perf_counter(), time.process_time()
        child = hatch(trained[i], members[i], noise=m.noise, seed=t.seed * 1000 + i, calib=calib)
        hatched = Seconds(time.perf_counter() - start, time.process_time() - cpu_start)
        bag = replace(hcfg, data=replace(cfg.data, bootstrap=derived_seed(t.seed, BAGGED, i) or 1)) \
            if m.bagging else hcfg
        run = fit(child, data, bag, m.hatch_epochs, t.lr * m.hatch_lr_factor, derived_seed(t.seed, HATCHED, i),
                  f"hatched-{i}-of-{len(members)}", spreading(cfg))
        mine[i] = scored(cfg, data, run, labels, num_params(members[i]) * m.hatch_epochs)
        mine[i].hatch = hatched
    out = gathered(cfg, mine)
    for i, r in enumerate(out):
        log(f"    {'hatched' if i in trained else 'alone'} {i}: {describe(members[i])} acc {r.acc:.2f}%")
    for mother in mothers:
        mother.snapshot_acc = mother.snapshot_acc or [out[mother.members[0]].acc]
    split = TimeSplit(total([c.first for c in chains]), total([c.cycles for c in chains]),
                      total([r.hatch for r in out]), total([r.seconds for r in out]))
    log("  time (wall / CPU s): " + ", ".join(f"{part} {getattr(split, part).wall:.1f} / "
                                             f"{getattr(split, part).cpu:.1f}" for part in vars(split)))
    return result("mothernets", cfg, out, labels, split, members, sum(c.flops for c in chains),
                  sum(c.param_epochs for c in chains), clusters=len(groups), mothers=mothers)


def snapshot_arch(cfg: RunConfig, members: list[Arch]) -> Arch:
    """The architecture a snapshot ensemble of these members trains (snapshot.member)."""
    if cfg.snapshot.member >= 0:
        return members[cfg.snapshot.member]
    return sorted(members, key=forward_flops)[(len(members) - 1) // 2]


def snapshot_ensemble(cfg: RunConfig, data: Dataset, members: list[Arch], labels: torch.Tensor,
                      method: str = "snapshot") -> MethodResult:
    """Snapshot Ensembles: one net (snapshot_arch) through `snapshot.cycles` warm-restart cycles, the last K end
    points averaged. The chain is sequential: where members are spread, rank 0 trains it and shares the scores."""
    s, t, k = cfg.snapshot, cfg.training, len(members)
    arch, cycles = snapshot_arch(cfg, members), s.cycles or k
    mine = {}
    if my_nets(cfg, [1.0]):  # one chain: rank 0's where spreading
        runs = warm_restarts(seeded(arch, 2 * 10**6 + t.seed), data, at_batch(cfg, s.batch_size),
                             [s.cycle_epochs] * cycles, t.lr * s.lr_factor,
                             [derived_seed(t.seed, SNAPSHOT_ENSEMBLE, j) for j in range(cycles)],
                             [f"{method}-{j}-of-{cycles}" for j in range(cycles)], spreading(cfg))
        mine[0] = [scored(cfg, data, r, labels, num_params(arch) * s.cycle_epochs) for r in runs]
    chain = gathered(cfg, mine)[0]
    log(f"  {cycles} cycles of {s.cycle_epochs:.3g} epochs of {describe(arch)}: acc "
        + ", ".join(f"{r.acc:.2f}%" for r in chain))
    earlier = chain[:-k]
    return result(method, cfg, chain[-k:], labels, TimeSplit(members=total([r.seconds for r in chain])), [arch],
                  sum(r.flops for r in earlier), sum(r.param_epochs for r in earlier), cycle_epochs=s.cycle_epochs)


def matched_snapshot(cfg: RunConfig, data: Dataset, members: list[Arch], labels: torch.Tensor,
                     mothernets_r: MethodResult, snapshot_r: MethodResult) -> MethodResult:
    """A Snapshot Ensemble that takes about MotherNets' training time: the snapshot chain's cycles scaled by
    MotherNets' wall seconds over that chain's (both measured at this size and budget; a chain's time grows
    with its epochs, less a small cost per cycle)."""
    s = cfg.snapshot
    scaled = s.cycle_epochs * mothernets_r.wall_s / snapshot_r.wall_s
    return snapshot_ensemble(replace(cfg, snapshot=replace(s, cycle_epochs=scaled)), data, members, labels,
                             "matched_snapshot")


def elapsed(start: float, what: str) -> float:
    """Seconds since `start`, logged: all of `what`'s work, evaluation included, and when spreading until the
    slowest rank's results arrived (the records' wall_s instead add up each net's training, over all ranks)."""
    seconds = time.perf_counter() - start
    log(f"  {what}: {seconds:.1f}s elapsed")
    return seconds


def prepare(cfg: RunConfig) -> tuple[Dataset, list[Arch], list[int]]:
    """Everything that can be wrong with the input, checked before any training: data, members, sizes, g, the
    snapshot chain."""
    check_writable(cfg.run.out, "run.out", "pass --run.out with a writable path")
    data = load(cfg.data.dataset, cfg.data.path, cfg.data.download)
    members = members_of(cfg, data)
    sizes = cfg.run.sizes or [len(members)]
    if max(sizes) > len(members):
        raise ValueError(f"run.sizes: {max(sizes)} exceeds the {len(members)} explicit members")
    for k in sizes:
        if cfg.mothernet.clusters_for(k) > k:
            raise ValueError(f"mothernet.clusters: g={cfg.mothernet.clusters} is larger than the ensemble size {k}; "
                             "use g <= K")
        for idx in cluster(members[:k], cfg.mothernet.clusters_for(k)):
            mother_of([members[i] for i in idx])
    if "snapshot" in cfg.run.methods:
        s = cfg.snapshot
        if s.cycles and s.cycles < max(sizes):
            raise ValueError(f"snapshot.cycles: {s.cycles} cycles cannot give an ensemble of {max(sizes)}; use "
                             f">= {max(sizes)} or 0 (= K)")
        if s.member >= min(sizes):
            raise ValueError(f"snapshot.member: {s.member} is not one of the first {min(sizes)} members; use "
                             f"0..{min(sizes) - 1} or -1 (the median)")
    return data, members, sizes


def experiment(cfg: RunConfig, data: Dataset, members: list[Arch], sizes: list[int],
               done: Callable[[list[MethodResult]], None] = lambda results: None) -> list[MethodResult]:
    """Every method of run.methods at every budget and ensemble size; the independent baseline's first k
    members serve every size k of a budget. `done` gets the results so far after each size (a long sweep's
    report is written as it goes)."""
    torch.set_num_threads(cfg.training.threads or torch.get_num_threads())
    if cfg.training.spread == "members":
        init_distributed()  # ranks exchange members' results: join torchrun's process group before any net trains
        if spreading(cfg):
            gather_group()
    # The first optimizer step in a process imports torch._dynamo (~3 s): pay it before anything is timed.
    warm = torch.nn.Parameter(torch.zeros(1))
    warm.grad = torch.zeros(1)
    torch.optim.AdamW([warm]).step()
    if cfg.training.engine == "titan":
        cpu_peak_tflops(torch.float32)  # titan's MFU measures it once per process: not in the first member's time
    labels = eval_labels(data, cfg.data.test_limit)
    log(f"{data.name}: {len(data.train_y)} train / {len(labels)} test images on {cfg.training.torch_device()}, "
        "members: " + ", ".join(describe(a) for a in members[:max(sizes)]))
    results = []
    for budget in cfg.run.budgets or [1.0]:
        bcfg = budgeted(cfg, budget)
        base: list[NetScore] = []
        base_elapsed = 0.0
        for k in sizes:
            # The methods train in turn at each size, not each over all sizes, so that a machine that speeds up or
            # slows down during the sweep moves every side of each ratio alike.
            at_k = {}
            for method in cfg.run.methods:
                log(f"K={k}" + (f", budget x{budget:g}" if cfg.run.budgets else "") + f": {method}")
                start = time.perf_counter()
                if method == "independent":
                    first = len(base)
                    base += independent(bcfg, data, members[:k], labels, first=first)
                    base_elapsed += elapsed(start, f"independent {first}-{k - 1}")
                    r = result(method, bcfg, base[:k], labels, TimeSplit(members=total([s.seconds for s in base[:k]])),
                               members[:k])
                    r.elapsed_s = base_elapsed
                elif method == "matched_snapshot":
                    r = matched_snapshot(bcfg, data, members[:k], labels, at_k["mothernets"], at_k["snapshot"])
                    r.elapsed_s = elapsed(start, method)
                else:
                    r = (mothernets if method == "mothernets" else snapshot_ensemble)(bcfg, data, members[:k], labels)
                    r.elapsed_s = elapsed(start, method)
                r.budget = budget
                # In the log too: a long sweep stopped before its report keeps every finished method's figure.
                log(f"  {method}: ensemble {r.ensemble_acc:.2f}%, training {r.wall_s:.1f} s wall / {r.cpu_s:.1f} s CPU")
                at_k[method] = r
            base_r = at_k.get("independent")
            for r in at_k.values():
                if base_r is not None and r is not base_r:
                    r.speedup = Speedup(base_r.train_cost / r.train_cost, base_r.wall_s / r.wall_s,
                                        base_r.cpu_s / r.cpu_s)
            results += at_k.values()
            done(results)
    return results
