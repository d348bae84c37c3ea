"""The experiment: MotherNets (cluster, train one mother per cluster, hatch and briefly train each member) and the
independent baseline (every member from scratch) at each ensemble size of a sweep, measured side by side."""

from __future__ import annotations

import os
import time
from dataclasses import replace

import torch

from morphens.arch import Arch, arch_from_dict, arch_to_dict, describe, forward_flops
from morphens.config import RunConfig
from morphens.data import Dataset, Loader, derived_seed, load
from morphens.models import Net, num_params
from morphens.morph import hatch
from morphens.mother import cluster, mother_of
from morphens.spread import gather_group, gathered, my_nets, owners, shared_nets, spreading
from morphens.train import Fit, accuracy, ensemble_accuracy, eval_labels, fit, predict, seeded
from titan.components.metrics.throughput import cpu_peak_tflops
from titan.distributed.runtime import init_distributed
from titan.tools.cli import check_writable

INDEPENDENT, MOTHER, SNAPSHOT, HATCHED, BAGGED = range(5)
"""Roles in the seeds of a run's data orders and resamples: `derived_seed(training.seed, role, *indices)`."""
TIME_PARTS = ("mother_s", "snapshots_s", "hatch_s", "members_s")
"""MotherNets' wall time in parts (`time` in its record; each has a `_cpu_s` twin): the mothers' first training,
their snapshot cycles, hatching, and the hatched (or lone) members' training."""


def members_of(cfg: RunConfig, data: Dataset) -> list[Arch]:
    e = cfg.ensemble
    if e.members:
        return [arch_from_dict(m, data.in_shape, data.num_classes) for m in e.members]
    return e.generator().sample(max(cfg.run.sizes or [e.size]), data.in_shape, data.num_classes, e.seed)


def log(msg: str) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        print(msg, flush=True)


def scratch(cfg: RunConfig, data: Dataset, arch: Arch, i: int, solo: bool = False) -> Fit:
    """Member i trained from scratch for training.epochs (its seeds depend only on i)."""
    t = cfg.training
    return fit(seeded(arch, t.seed * 1000 + i), data, cfg, t.epochs, t.lr, derived_seed(t.seed, INDEPENDENT, i),
               f"independent-{i}", solo)


def scored(cfg: RunConfig, data: Dataset, run: Fit, labels: torch.Tensor, param_epochs: float) -> dict:
    probs = predict(run.net, data, cfg.data.test_limit)
    return {"probs": probs, "acc": accuracy(probs, labels), "seconds": run.seconds, "cpu_seconds": run.cpu_seconds,
            "flops": run.flops, "param_epochs": param_epochs}


def independent(cfg: RunConfig, data: Dataset, members: list[Arch], labels: torch.Tensor,
                first: int = 0) -> list[dict]:
    """Members first, first + 1, ... from scratch (spread over the ranks with `training.spread members`); one entry
    per member trained."""
    mine = {}
    for j in my_nets(cfg, [forward_flops(a) for a in members[first:]]):
        i = first + j
        mine[i] = scored(cfg, data, scratch(cfg, data, members[i], i, spreading(cfg)), labels,
                         num_params(members[i]) * cfg.training.epochs)
    out = gathered(cfg, mine)
    for i, r in enumerate(out, first):
        log(f"  independent {i}: {describe(members[i])} acc {r['acc']:.2f}% in {r['seconds']:.1f}s")
    return out


def at_batch(cfg: RunConfig, batch_size: int) -> RunConfig:
    """`cfg` training at `batch_size` (0 = training.batch_size)."""
    return replace(cfg, training=replace(cfg.training, batch_size=batch_size or cfg.training.batch_size))


def chain_epochs(cfg: RunConfig, count: int) -> float:
    """Epochs of a mother and its `count - 1` warm-restart cycles."""
    return cfg.mothernet.mother_epochs + (count - 1) * cfg.mothernet.snapshot_epochs


def mother_chain(cfg: RunConfig, data: Dataset, arch: Arch, c: int, name: str, labels: torch.Tensor,
                 count: int) -> tuple[list[Net], dict]:
    """Cluster c's mother and its `count - 1` warm-restart cycles, trained on this rank alone where members are
    spread: the nets (each cycle's end point) and their record (accuracies, flops, param_epochs, wall / CPU
    seconds)."""
    m, t = cfg.mothernet, cfg.training
    mcfg, lr, solo = at_batch(cfg, m.batch_size), t.lr * m.lr_factor, spreading(cfg)
    runs = [fit(seeded(arch, 10**6 + t.seed * 1000 + c), data, mcfg, m.mother_epochs, lr,
                derived_seed(t.seed, MOTHER, c), name, solo)]
    for s in range(1, count):  # each warm restart ends in a distinct, converged mother
        runs.append(fit(runs[-1].net, data, mcfg, m.snapshot_epochs, lr, derived_seed(t.seed, SNAPSHOT, c, s),
                        f"{name}-snapshot-{s}", solo))
    return [r.net for r in runs], {
        "acc": [accuracy(predict(r.net, data, cfg.data.test_limit), labels) for r in runs],
        "flops": sum(r.flops for r in runs), "param_epochs": num_params(arch) * chain_epochs(cfg, count),
        "mother_s": runs[0].seconds, "mother_cpu_s": runs[0].cpu_seconds,
        "snapshots_s": sum(r.seconds for r in runs[1:]), "snapshots_cpu_s": sum(r.cpu_seconds for r in runs[1:])}


def train_mothers(cfg: RunConfig, data: Dataset, members: list[Arch], labels: torch.Tensor,
                  groups: list[list[int]]) -> tuple[dict, list[dict], dict]:
    """One mother per cluster of more than one member, then its warm-restart cycles (`mothernet.snapshots`), the
    mothers spread over the ranks like members; returns (member index -> the snapshot it hatches from, the
    mothers' records, their cost and time: flops, param_epochs, and wall / CPU seconds of the first training and
    of the snapshot cycles)."""
    m = cfg.mothernet
    archs = [mother_of([members[i] for i in idx]) for idx in groups]
    mothers = [{"arch": describe(a), "members": idx} for a, idx in zip(archs, groups)]
    chains = [(c, min(m.snapshots, len(idx))) for c, idx in enumerate(groups) if len(idx) > 1]
    costs = [forward_flops(archs[c]) * chain_epochs(cfg, count) for c, count in chains]
    mine, records = {}, {}
    for j in my_nets(cfg, costs):
        c, count = chains[j]
        mine[j], records[j] = mother_chain(cfg, data, archs[c], c, f"mother-{c}-of-{len(members)}", labels, count)
    nets = shared_nets(cfg, mine, [(archs[c], count) for c, count in chains], owners(cfg, costs))
    cost = dict.fromkeys(("flops", "param_epochs", "mother_s", "mother_cpu_s", "snapshots_s", "snapshots_cpu_s"), 0.0)
    trained = {}
    for (c, count), runs, record in zip(chains, nets, gathered(cfg, records)):
        idx = groups[c]
        trained.update({i: runs[j % count] for j, i in enumerate(idx)})
        for key in cost:
            cost[key] += record[key]
        mothers[c]["acc"], mothers[c]["snapshot_acc"] = record["acc"][-1], record["acc"]
        log(f"  mother {c} {describe(archs[c])} for members {idx}: acc "
            + ", ".join(f"{a:.2f}%" for a in record["acc"]))
    return trained, mothers, cost


def mothernets(cfg: RunConfig, data: Dataset, members: list[Arch], labels: torch.Tensor) -> dict:
    """Clusters the members and trains one mother per cluster (with `mothernet.snapshots` > 1, followed by
    warm-restart cycles whose end points the cluster's members hatch from in turn), then hatches and trains every
    member (mothers and members spread over the ranks with `training.spread members`); a member alone in its
    cluster is its own mother and trains as it would independently. Times count training and hatching, not
    evaluation, as for the independent members; `time` splits them into the mothers' first training, their
    snapshot cycles, hatching and the members' training (wall and CPU seconds)."""
    m, t = cfg.mothernet, cfg.training
    calib = next(iter(Loader(data, m.calib_batch, augmented=False, limit=cfg.data.train_limit)))[0]
    groups = cluster(members, m.clusters_for(len(members)))
    trained, mothers, cost = train_mothers(cfg, data, members, labels, groups)
    hcfg, mine = at_batch(cfg, m.hatch_batch_size), {}
    epochs = [m.hatch_epochs if i in trained else t.epochs for i in range(len(members))]
    for i in my_nets(cfg, [forward_flops(a) * e for a, e in zip(members, epochs)]):
        if i not in trained:
            mine[i] = scored(cfg, data, scratch(cfg, data, members[i], i, spreading(cfg)), labels,
                             num_params(members[i]) * t.epochs)
            mine[i]["hatch_s"] = mine[i]["hatch_cpu_s"] = 0.0
            continue
        start, cpu_start = time.perf_counter(), time.process_time()
        child = hatch(trained[i], members[i], noise=m.noise, seed=t.seed * 1000 + i, calib=calib)
        hatch_s, hatch_cpu_s = time.perf_counter() - start, time.process_time() - cpu_start
        bag = replace(hcfg, data=replace(cfg.data, bootstrap=derived_seed(t.seed, BAGGED, i) or 1)) \
            if m.bagging else hcfg
        run = fit(child, data, bag, m.hatch_epochs, t.lr * m.hatch_lr_factor, derived_seed(t.seed, HATCHED, i),
                  f"hatched-{i}-of-{len(members)}", spreading(cfg))
        mine[i] = scored(cfg, data, run, labels, num_params(members[i]) * m.hatch_epochs)
        mine[i].update(hatch_s=hatch_s, hatch_cpu_s=hatch_cpu_s)
    out = gathered(cfg, mine)
    for i, r in enumerate(out):
        log(f"    {'hatched' if i in trained else 'alone'} {i}: {describe(members[i])} acc {r['acc']:.2f}%")
    for mother in mothers:
        mother.setdefault("acc", out[mother["members"][0]]["acc"])
    total = lambda key: sum(r[key] for r in out)
    split = {"mother_s": cost["mother_s"], "snapshots_s": cost["snapshots_s"], "hatch_s": total("hatch_s"),
             "members_s": total("seconds"), "mother_cpu_s": cost["mother_cpu_s"],
             "snapshots_cpu_s": cost["snapshots_cpu_s"], "hatch_cpu_s": total("hatch_cpu_s"),
             "members_cpu_s": total("cpu_seconds")}
    log("  time (wall / CPU s): " + ", ".join(f"{k[:-2]} {split[k]:.1f} / {split[k[:-2] + '_cpu_s']:.1f}"
                                             for k in TIME_PARTS))
    return {"method": "mothernets", "ensemble_size": len(members), "wall_s": sum(split[k] for k in TIME_PARTS),
            "cpu_s": sum(split[k.replace("_s", "_cpu_s")] for k in TIME_PARTS), "member_acc": [r["acc"] for r in out],
            "ensemble_acc": ensemble_accuracy([r["probs"] for r in out], labels),
            "train_cost": cost["flops"] + total("flops"), "param_epochs": cost["param_epochs"] + total("param_epochs"),
            "clusters": len(groups), "mothers": mothers, "time": split}


def elapsed(start: float, what: str) -> float:
    """Seconds since `start`, logged: all of `what`'s work, evaluation included, and when spreading until the
    slowest rank's results arrived (the records' wall_s instead add up each net's training, over all ranks)."""
    seconds = time.perf_counter() - start
    log(f"  {what}: {seconds:.1f}s elapsed")
    return seconds


def prepare(cfg: RunConfig) -> tuple[Dataset, list[Arch], list[int]]:
    """Everything that can be wrong with the input, checked before any training: data, members, sizes, g."""
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
    return data, members, sizes


def experiment(cfg: RunConfig, data: Dataset, members: list[Arch], sizes: list[int]) -> list[dict]:
    """MotherNets at every size, and the independent baseline (its first k members) beside each."""
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
    log(f"{data.name}: {len(data.train_y)} train / {len(labels)} test images, members: "
        + ", ".join(describe(a) for a in members[:max(sizes)]))
    results, base, base_elapsed = [], [], 0.0
    for k in sizes:
        log(f"K={k}: MotherNets with g={cfg.mothernet.clusters_for(k)}")
        start = time.perf_counter()
        mn = mothernets(cfg, data, members[:k], labels)
        mn["elapsed_s"] = elapsed(start, "MotherNets")
        mn["members"] = [arch_to_dict(a) for a in members[:k]]
        results.append(mn)
        if cfg.run.baseline:
            # The baseline's members train beside each size's MotherNets, not all before them, so that a machine
            # that speeds up or slows down during the sweep moves both sides of each ratio alike.
            start, first = time.perf_counter(), len(base)
            base += independent(cfg, data, members[:k], labels, first=first)
            base_elapsed += elapsed(start, f"independent {first}-{k - 1}")
            mine = base[:k]
            ind = {"method": "independent", "ensemble_size": k, "elapsed_s": base_elapsed,
                   "wall_s": sum(r["seconds"] for r in mine),
                   "cpu_s": sum(r["cpu_seconds"] for r in mine),
                   "member_acc": [r["acc"] for r in mine],
                   "ensemble_acc": ensemble_accuracy([r["probs"] for r in mine], labels),
                   "train_cost": sum(r["flops"] for r in mine), "param_epochs": sum(r["param_epochs"] for r in mine)}
            mn["cost_ratio"] = ind["train_cost"] / mn["train_cost"]
            mn["wall_ratio"] = ind["wall_s"] / mn["wall_s"]
            mn["cpu_ratio"] = ind["cpu_s"] / mn["cpu_s"]
            results.append(ind)
    return results
