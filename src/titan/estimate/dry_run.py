"""`python -m titan.estimate --config PATH.toml --comm.world_size N [--section.key V] [--estimate.KEY V]`

A dry run of a training layout at any world size in one CPU process: the real model on the meta device, the
meshes on a fake process group, the training code's pipeline split and parallelize function for one rank per
pipeline position. It reports what each rank holds and moves per step, and an analytical step time. Options
of the step-time model (`--estimate.*`, see `--help`) are not part of the training config.
"""

from __future__ import annotations

import dataclasses
import json
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from titan.builders import check_dump_folder_writable, check_layout, stand_in_model_args
from titan.components.metrics.throughput import gpu_peak_tflops
from titan.config import parse_command_line
from titan.config.manager import ConfigManager, field_docs, split_cli
from titan.distributed import ParallelDims
from titan.distributed.pipeline import stages_per_rank
from titan.estimate.costs import GIB, Hardware, rank_costs, step_estimate
from titan.estimate.layout import dry_run_rank, make_layout
from titan.models import get_model_spec
from titan.tools.cli import UserError, entry_point, report_done


@dataclass
class EstimateOptions:
    """The dry run's own options beside a training config (command line: --estimate.KEY VALUE)."""

    estimate: Hardware = field(default_factory=Hardware)


ESTIMATE_OPTIONS = ConfigManager(EstimateOptions, "python -m titan.estimate --config PATH.toml [--estimate.KEY V]")


def split_args(argv: list[str]) -> tuple[list[str], Hardware]:
    """Takes the `--estimate.KEY VALUE` options out of argv; the rest is a training config."""
    config_path, options = split_cli(argv)
    ours = [(name, raw) for name, raw in options if name.startswith("estimate.")]
    rest = (["--config", config_path] if config_path else []) + [
        f"--{name}={raw}" for name, raw in options if not name.startswith("estimate.")]
    return rest, ESTIMATE_OPTIONS.load("", ours).estimate


@dataclass
class Plan:
    """What the dry run read back of a run, independent of the hardware assumptions."""

    job_config: object
    args: object
    dims: ParallelDims
    lay: object
    infos: list
    num_params: int
    flops_per_token: float


def plan(job_config) -> Plan:
    """The dry run: the model on the meta device, parallelized rank by rank under a fake process group."""
    world = job_config.comm.world_size
    if world < 1:
        raise UserError("comm.world_size: pass the number of GPUs to estimate for, e.g. --comm.world_size 512")
    dims = ParallelDims.from_config(job_config.parallelism, world)
    spec = get_model_spec(job_config.model.name, job_config.model.spec)
    args = stand_in_model_args(spec, job_config)
    global_batch, _ = check_layout(job_config, dims, spec, args)
    lay = make_layout(args, dims, job_config, global_batch)
    with torch.device("meta"):
        model = spec.build_model(args)
    infos = [dry_run_rank(spec, model, job_config, dims, r) for r in range(dims.pp)]
    # The trainer's MFU numerator, so that estimated and measured MFU compare.
    num_params = sum(p.numel() for p in model.parameters())
    flops_per_token = (spec.flops_per_token(model, args, job_config.training.seq_len) if spec.flops_per_token
                       else 6.0 * num_params)
    return Plan(job_config, args, dims, lay, infos, num_params, flops_per_token)


def estimate(job_config, hw: Hardware, planned: Plan | None = None) -> dict:
    """The report of `job_config` under the assumptions `hw`; `planned`: its dry run, if already done."""
    peak_tflops = hw.peak_tflops or gpu_peak_tflops(hw.gpu)
    if peak_tflops is None:
        raise UserError(f"estimate.gpu: no peak known for {hw.gpu!r}; pass --estimate.peak_tflops")
    p = planned or plan(job_config)
    lay, dims = p.lay, p.dims
    ranks = [rank_costs(lay, info, hw, peak_tflops * 1e12) for info in p.infos]
    distinct = sum(part.distinct_params for info in p.infos for part in info.parts)
    return {
        "model": f"{job_config.model.name}/{job_config.model.flavor}",
        "num_params": p.num_params,
        "params_over_all_shards": distinct,
        "flops_per_token": p.flops_per_token,
        "layout": {"world_size": dims.world_size, "pp": dims.pp, "dp_replicate": dims.dp_replicate,
                   "dp_shard": dims.dp_shard, "cp": dims.cp, "tp": dims.tp, "ep": dims.ep, "schedule": lay.schedule,
                   "stages": dims.pp * stages_per_rank(lay.schedule), "microbatches": lay.microbatches,
                   "microbatch_seqs": lay.microbatch_seqs, "grad_accum_steps": lay.accum,
                   "seq_len": lay.seq_len, "ac": job_config.activation_checkpoint.mode},
        "hardware": dataclasses.asdict(hw) | {"peak_tflops": peak_tflops},
        "ranks": ranks,
        "step": step_estimate(lay, ranks, peak_tflops * 1e12, p.flops_per_token),
    }


def shown_ranks(ranks: list[dict]) -> list[dict]:
    """First, middle and last pipeline position (fewer when there are fewer)."""
    picks = sorted({0, len(ranks) // 2, len(ranks) - 1})
    return [ranks[i] for i in picks]


def format_report(report: dict) -> str:
    lay, step = report["layout"], report["step"]
    lines = [
        f"{report['model']}: {report['num_params'] / 1e9:.2f}B params (sum over all shards "
        f"{report['params_over_all_shards'] / 1e9:.2f}B), world {lay['world_size']} = pp {lay['pp']} x dp_replicate "
        f"{lay['dp_replicate']} x dp_shard {lay['dp_shard']} x cp {lay['cp']} x tp {lay['tp']}"
        + (f", expert parallel {lay['ep']}" if lay["ep"] > 1 else ""),
        f"seq {lay['seq_len']}, {lay['microbatches']} microbatch(es) of {lay['microbatch_seqs']} seq x "
        f"{lay['grad_accum_steps']} accumulation step(s), AC {lay['ac']}"
        + (f", {lay['schedule']} over {lay['stages']} stages" if lay["pp"] > 1 else ""),
        "",
        f"{'rank':>5} {'stages':>8} {'layers':>7} {'params':>8} {'grads':>7} {'optim':>7} {'gathrd':>7} "
        f"{'gradbuf':>7} {'activ':>7} {'logits':>7} {'total':>7}  (GiB)",
    ]
    for r in shown_ranks(report["ranks"]):
        m = {k: v / GIB for k, v in r["memory_bytes"].items()}
        lines.append(
            f"{r['rank']:>5} {','.join(map(str, r['stages'])):>8} {sum(map(len, r['layers'])):>7} "
            f"{m['params']:>8.2f} {m['grads']:>7.2f} {m['optimizer']:>7.2f} {m['gathered_params']:>7.2f} "
            f"{m['grad_buffers']:>7.2f} {m['activations'] + m['recompute_working_set']:>7.2f} {m['logits']:>7.2f} "
            f"{r['memory_gib']:>7.2f}" + ("" if r["fits"] else f"  > {report['hardware']['memory_gib']:g} GiB!"))
    lines += ["", f"{'rank':>5} {'group':>6} {'op':>15} {'size':>5} {'calls':>7} {'MiB/call':>9} {'wire GiB':>9} "
              f"{'seconds':>8}"]
    for r in shown_ranks(report["ranks"]):
        for c in r["collectives"]:
            lines.append(f"{r['rank']:>5} {c['group']:>6} {c['op']:>15} {c['group_size']:>5} {c['calls']:>7g} "
                         f"{c['bytes_per_call'] / 2**20:>9.1f} {c['wire_bytes'] / GIB:>9.2f} {c['seconds']:>8.3f}"
                         + (" (overlapped)" if c["overlapped"] else ""))
    for r in shown_ranks(report["ranks"]):
        a2a = r["all_to_all_bytes"]
        if sum(a2a.values()):
            lines.append(f"{r['rank']:>5} expert all-to-all per step: {a2a['intra_node'] / GIB:.2f} GiB to ranks in "
                         f"the node, {a2a['inter_node'] / GIB:.2f} GiB across nodes")
    lines += ["", f"step {step['step_s']:.2f} s for {step['global_batch']} sequences: "
              f"{step['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU, MFU {100 * step['mfu']:.1f}% "
              f"({report['hardware']['gpu']}, assumed kernel MFU {report['hardware']['mfu']:g}"
              + (f", routing imbalance {report['hardware']['moe_imbalance']:g} assumed" if lay["ep"] > 1 else "") + ")"]
    return "\n".join(lines)


def help_text() -> str:
    docs = field_docs(Hardware)
    lines = [__doc__.strip(), "", "[estimate]"]
    for f in dataclasses.fields(Hardware):
        lines.append(f"  --estimate.{f.name} (default {f.default!r})\n      {docs.get(f.name, '')}")
    lines.append("\nTraining options: see `python -m titan.train --help`.")
    return "\n".join(lines)


@entry_point
def main(argv: list[str]) -> int:
    start = time.perf_counter()
    # ParallelDims.submesh slices flattened dims, which torch warns about once per mesh; the training run logs
    # it too, and here it would interleave with the table.
    warnings.filterwarnings("ignore", message="Slicing a flattened dim", category=UserWarning)
    if "--help" in argv or "-h" in argv:
        print(help_text())
        return 0
    rest, hw = split_args(argv)
    job_config = parse_command_line(rest)
    check_dump_folder_writable(job_config.dump_folder)
    report = estimate(job_config, hw)
    print(format_report(report))
    out = Path(job_config.dump_folder, "estimate.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    step, peak = report["step"], max(r["memory_gib"] for r in report["ranks"])
    report_done(f"dry run of {report['model']} on {report['layout']['world_size']} ranks", time.perf_counter() - start,
                f"estimated step {step['step_s']:.3g} s, {step['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU, "
                f"peak {peak:.1f} GiB per rank", str(out))
    return 0

