"""The analytical half of the estimator: memory, collectives and step time of one rank, from what the dry run
read back (local shard sizes, FSDP units, checkpointed blocks) and the model's shapes.

Conventions: FLOPs as in `flops_per_token` (6 x the non-embedding parameters a token uses, k of an MoE layer's E
experts, + 6·L·H·(qk + v head dims)·T per token), so the stages' FLOPs add up to the trainer's MFU numerator; bf16
peak; collective times by the ring formulas over the slower of NVLink and the network for the group's span; an
all-to-all (expert parallel, titan.estimate.experts) sends each peer's share over its own link. Collective groups:
tp, cp, pp, fsdp/hsdp (the blocks and the root), ep (token dispatch and combine), efsdp/ehsdp (the experts' units,
and under TP the average of their gradients over it), mfsdp/mhsdp (the MoE layers' units under TP).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from titan.distributed.pipeline import stage_ids_for_rank, stages_per_rank
from titan.estimate.blocks import (
    attention_dims,
    latent_attention,
    layer_params,
    routed_active_params,
)
from titan.estimate.experts import ep_collectives, expert_fsdp_collectives, moe_fsdp_collectives
from titan.estimate.layout import Layout, RankInfo
from titan.estimate.memory import rank_memory

GIB = 2**30
# Pipeline bubble relative to (p-1)/v microbatch times: zero-bubble schedules fill about two thirds of it by
# splitting the backward into input and weight gradients.
BUBBLE_FACTOR = {"InterleavedZeroBubble": 1 / 3, "ZBVZeroBubble": 1 / 3, "DualPipeV": 1 / 3}


@dataclass
class Hardware:
    """Assumptions of the step-time model (command line: --estimate.KEY VALUE)."""

    gpu: str = "H100"
    """GPU name looked up in titan.components.metrics.throughput for the dense bf16 peak."""
    peak_tflops: float = 0.0
    """Dense bf16 peak TFLOP/s per GPU (0 = from gpu)."""
    mfu: float = 0.5
    """Fraction of peak the compute kernels sustain; recomputation, communication and bubbles come on top. An
    assumption, like the two speed-ups: titan.estimate.calibrate fits all three on measured runs."""
    compile_speedup: float = 1.15
    """Compute speed-up assumed with compile.enable (TorchTitan's measured ratio on 8B at 8 H100s: an input)."""
    float8_speedup: float = 1.3
    """Speed-up of the linear layers assumed with float8.enable (likewise TorchTitan's 8B ratio: an input)."""
    intra_node_gbps: float = 350.0
    """Achieved collective bandwidth inside a node, GB/s per GPU (NVLink)."""
    inter_node_gbps: float = 45.0
    """Achieved collective bandwidth across nodes, GB/s per GPU (a 400 Gb/s NIC per GPU)."""
    gpus_per_node: int = 8
    """GPUs per node: a group whose ranks fit in one node uses intra_node_gbps."""
    latency_us: float = 20.0
    """Fixed cost per collective call."""
    memory_gib: float = 80.0
    """Device memory per GPU; a plan above it is flagged."""
    moe_imbalance: float = 1.0
    """Routing imbalance under expert parallel, an input (not predicted): the busiest expert-parallel rank's routed
    token copies over the mean, 1 = balanced. That rank's expert compute, all-to-all bytes and experts' activations
    grow by it, and the step waits for it. The moe_imbalance that titan.train logs (max / mean tokens per expert,
    worst layer) bounds it from above: a rank holds several experts, seldom all of the busiest."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name not in ("gpu", "peak_tflops") and value <= 0:
                raise ValueError(f"estimate.{f.name} must be > 0, got {value}")
        if self.moe_imbalance < 1:
            raise ValueError(f"estimate.moe_imbalance is max / mean tokens, so >= 1 (1 = balanced), got "
                             f"{self.moe_imbalance}")
        if self.peak_tflops < 0:
            raise ValueError(f"estimate.peak_tflops must be >= 0 (0 = from gpu), got {self.peak_tflops}")


class Collectives:
    """Per-step collectives of one rank: group, op, calls, bytes per call, wire bytes and seconds."""

    def __init__(self, hw: Hardware, dims):
        self.hw, self.dims, self.rows = hw, dims, []
        # Expert parallel splits dp_shard into dp_shard_mod_ep x dp_shard_in_ep (dp_shard x 1 without it): the
        # expert group is dp_shard_in_ep x cp x tp.
        in_ep = dims.ep // (dims.cp * dims.tp) if dims.ep > 1 else 1
        sizes = {"pp": dims.pp, "dp_replicate": dims.dp_replicate, "dp_shard_mod_ep": dims.dp_shard // in_ep,
                 "dp_shard_in_ep": in_ep, "cp": dims.cp, "tp": dims.tp}
        order = list(sizes)
        self.stride = {n: _prod(sizes[m] for m in order[i + 1:]) for i, n in enumerate(order)}
        self.stride["dp_shard"] = self.stride["dp_shard_in_ep"]

    def ranks_in_node(self, innermost: str, size: int) -> int:
        """Of a group of `size` ranks, those in one node. Mesh dims run pp, dp_replicate, dp_shard_mod_ep,
        dp_shard_in_ep, cp, tp (tp fastest): a group spans stride x size ranks."""
        return max(1, min(size, self.hw.gpus_per_node // self.stride[innermost]))

    def bandwidth(self, innermost: str, size: int) -> float:
        intra = self.ranks_in_node(innermost, size) == size
        return 1e9 * (self.hw.intra_node_gbps if intra else self.hw.inter_node_gbps)

    def add(self, group: str, innermost: str, size: int, op: str, calls: float, nbytes: float,
            overlapped: bool) -> None:
        if size <= 1 or calls == 0:
            return
        factor = {"all_gather": (size - 1) / size, "reduce_scatter": (size - 1) / size,
                  "all_reduce": 2 * (size - 1) / size, "ring_kv": (size - 1) / size, "send_recv": 1.0}[op]
        wire = factor * nbytes * calls
        seconds = wire / self.bandwidth(innermost, size) + calls * self.hw.latency_us * 1e-6
        intra = self.ranks_in_node(innermost, size) == size
        self.rows.append({"group": group, "op": op, "group_size": size, "calls": calls, "bytes_per_call": nbytes,
                          "wire_bytes": wire, "intra_node_bytes": wire if intra else 0.0,
                          "inter_node_bytes": 0.0 if intra else wire, "seconds": seconds, "overlapped": overlapped})

    def add_all_to_all(self, group: str, innermost: str, size: int, calls: float, nbytes: float) -> None:
        """An all-to-all of `nbytes` a call spread evenly over the group: the shares of peers in the node go over
        NVLink, the others over the network, both at once; the rank's own share stays."""
        if size <= 1 or calls == 0:
            return
        local = self.ranks_in_node(innermost, size)
        intra, inter = nbytes * calls * (local - 1) / size, nbytes * calls * (size - local) / size
        seconds = (max(intra / (1e9 * self.hw.intra_node_gbps), inter / (1e9 * self.hw.inter_node_gbps))
                   + calls * self.hw.latency_us * 1e-6)
        self.rows.append({"group": group, "op": "all_to_all", "group_size": size, "calls": calls,
                          "bytes_per_call": nbytes, "wire_bytes": intra + inter, "intra_node_bytes": intra,
                          "inter_node_bytes": inter, "seconds": seconds, "overlapped": False})

    def seconds(self, group: str) -> float:
        return sum(r["seconds"] for r in self.rows if r["group"] == group)


def _prod(values) -> int:
    out = 1
    for v in values:
        out *= v
    return out


def _stage_owner(dims, schedule: str) -> dict[int, int]:
    return {s: r for r in range(dims.pp) for s in stage_ids_for_rank(r, dims.pp, schedule)}


def _flops(lay: Layout, part, tokens: int, recompute: bool = True, load: float = 1.0) -> tuple[float, float]:
    """(linear, attention) FLOPs of one rank for a part over `tokens` local tokens; `load`: its routed experts'
    token copies over the balanced count (under TP the MoE layers compute the rank's tokens / tp with whole weights,
    the same FLOPs as tokens with weights / tp)."""
    a, t = lay.args, lay.dims.tp
    heads, qk, v = attention_dims(a)
    attn = 6 * heads * (qk + v) * lay.seq_len
    n = len(part.layers)
    # A block's FLOPs are 6 x the weights a token uses: an MoE block's router, shared and k of its E experts.
    active = sum(part.block_active_params)
    if any(part.block_moe):
        active += (load - 1) * sum(part.block_moe) * routed_active_params(a)
    linear = 6 * active + (6 * (a.dim * a.vocab_size + a.dim) if part.has_output else 0)
    attention = attn * n
    if recompute and n:
        # Full recompute repeats the forward (a third of 6N, and of the attention); op-SAC redoes wk, wo, w3 of a
        # GQA block with a dense SwiGLU, and about half of the matmuls of others (every second one).
        gqa_dense = not latent_attention(a) and not any(part.block_moe)
        lp = layer_params(a) if gqa_dense else {}
        op_redone = 2 * (lp["wk"] + lp["wo"] + lp["w3"]) if gqa_dense else active / n
        linear += 2 * active / n * part.full_ac_blocks + op_redone * part.op_ac_blocks
        attention += attn / 3 * part.full_ac_blocks
    return linear * tokens / t, attention * tokens / t


def _tp_collectives(col: Collectives, lay: Layout, info: RankInfo, passes: int) -> None:
    # Tensor/sequence parallel: each block gathers before and reduce-scatters after attention and a dense MLP,
    # mirrored in backward; a MoE layer runs on the rank's sequence shard, with neither. Recomputing a block repeats
    # its gathers; of its reduce-scatters, a fully recomputed block repeats the attention one (recomputation stops
    # once backward has what it needs: before a dense MLP's, after the attention's that a MoE layer's input needs)
    # and op-SAC none (its policy saves reduce-scatter outputs). Measured with metrics.comm_stats.
    a, t, c = lay.args, lay.dims.tp, lay.dims.cp
    act = lay.microbatch_seqs * (lay.seq_len // c) * a.dim * lay.param_bytes
    gathers = scatters = 0.0
    for p in info.parts:
        moe, dense = sum(p.block_moe), len(p.layers) - sum(p.block_moe)
        # Which blocks are checkpointed is not read back, only how many: MoE and dense ones in proportion.
        share = (p.full_ac_blocks + p.op_ac_blocks) / len(p.layers) if p.layers else 0.0
        ends = p.has_embedding + p.has_output
        gathers += 2 * moe + 4 * dense + share * (moe + 2 * dense) + ends
        scatters += 2 * moe + 4 * dense + p.full_ac_blocks + ends
    col.add("tp", "tp", t, "all_gather", gathers * passes, act, False)
    col.add("tp", "tp", t, "reduce_scatter", scatters * passes, act, False)
    if any(p.has_output for p in info.parts):
        logits = lay.microbatch_seqs * (lay.seq_len // c)
        if lay.loss_parallel:
            col.add("tp", "tp", t, "all_reduce", 3 * passes, logits * 4, False)
        else:
            col.add("tp", "tp", t, "all_gather", passes, logits * a.vocab_size * lay.param_bytes, False)


def _cp_collectives(col: Collectives, lay: Layout, info: RankInfo, passes: int) -> None:
    # Context parallel (torch's all-gather rotation): K and V (repeated to all query heads before SDPA) are
    # gathered in forward, again in backward and for fully recomputed blocks, and backward exchanges dK and dV
    # in fp32 (two calls); it overlaps the attention kernels. Latent attention pads K and V to one head width.
    if lay.dims.cp == 1:
        return
    heads, qk, v = attention_dims(lay.args)
    kv = 2 * lay.microbatch_seqs * lay.seq_len * (heads // lay.dims.tp) * max(qk, v) * lay.param_bytes
    blocks = sum(len(p.layers) for p in info.parts)
    kv_calls, grad_calls = 2 * blocks + sum(p.full_ac_blocks for p in info.parts), 2 * blocks
    ring_bytes = kv_calls * kv + grad_calls * kv / 2 * 4 / lay.param_bytes
    col.add("cp", "cp", lay.dims.cp, "ring_kv", (kv_calls + grad_calls) * passes,
            ring_bytes / (kv_calls + grad_calls), True)


def _pp_collectives(col: Collectives, lay: Layout, info: RankInfo, passes: int) -> None:
    # Pipeline: activations forward and their gradients backward at every boundary to a stage on another rank.
    dims = lay.dims
    owner = _stage_owner(dims, lay.schedule)
    num_stages = dims.pp * stages_per_rank(lay.schedule)
    boundary = lay.microbatch_seqs * (lay.seq_len // (dims.cp * dims.tp)) * lay.args.dim * lay.param_bytes
    crossings = sum((s > 0 and owner[s - 1] != info.pp_rank) + (s < num_stages - 1 and owner[s + 1] != info.pp_rank)
                    for s in (p.stage for p in info.parts))
    col.add("pp", "pp", dims.pp, "send_recv", 2 * crossings * passes, boundary, False)


def _fsdp_collectives(col: Collectives, lay: Layout, info: RankInfo, unsharded: int, local: int) -> int:
    """Adds FSDP/HSDP traffic; returns the number of FSDP units."""
    # All-gather unsharded (TP-local) parameters for forward and, when resharded after it, again for backward;
    # reduce-scatter gradients at each sync: once per step, or per schedule run under PP.
    dims, c = lay.dims, lay.dims.cp
    if dims.fsdp_enabled:
        shard_size, shard_inner = dims.dp_shard * c, "cp" if c > 1 else "dp_shard"
    else:
        shard_size, shard_inner = dims.dp_replicate, "dp_replicate"
    units = sum(len(p.block_params) + (p.root_params > 0) for p in info.parts)
    gather_rounds = lay.accum * (lay.microbatches if dims.pp_enabled and lay.reshard_after_forward else 1)
    kept = [p for p in info.parts if p.block_params]

    def per_round(key: str, forward: int) -> int:
        # apply_fsdp keeps each part's last block gathered after forward: backward gathers the others again.
        return forward + (forward - sum(getattr(p, key)[-1] for p in kept) if lay.reshard_after_forward else 0)

    elems = per_round("block_params", unsharded)
    float8_elems = per_round("block_float8_params", sum(sum(p.block_float8_params) for p in info.parts))
    float8_weights = sum(sum(p.block_float8_weights) for p in info.parts)
    gathers = gather_rounds * (units + (units - len(kept) if lay.reshard_after_forward else 0))
    syncs = (lay.accum if dims.pp_enabled else 1) * units
    col.add("fsdp", shard_inner, shard_size, "all_gather", gathers,
            gather_rounds * ((elems - float8_elems) * lay.param_bytes + float8_elems) / gathers, True)
    # Float8 all-gather: after the optimizer step one all-reduce per part takes every weight's amax over its shards
    # (and under TP over the TP group), as torchao's precompute_float8_dynamic_scale_for_fsdp.
    calls = sum(1 for p in info.parts if sum(p.block_float8_weights))
    for inner, size in ((shard_inner, shard_size), ("tp", dims.tp)):
        col.add("fsdp", inner, size, "all_reduce", calls, 4 * float8_weights / max(calls, 1), True)
    col.add("fsdp", shard_inner, shard_size, "reduce_scatter", syncs, unsharded * lay.reduce_bytes / units, True)
    if dims.fsdp_enabled and dims.dp_replicate > 1:
        col.add("hsdp", "dp_replicate", dims.dp_replicate, "all_reduce", syncs, local * lay.reduce_bytes / units,
                True)
    return units


def rank_costs(lay: Layout, info: RankInfo, hw: Hardware, peak_flops: float) -> dict:
    """Memory, collectives and per-microbatch compute of one rank (under expert parallel, the busiest one)."""
    tokens = lay.local_tokens
    passes = lay.microbatches * lay.accum
    col = Collectives(hw, lay.dims)
    # Without expert parallel every rank computes all k copies of its own tokens, however they are routed.
    load = hw.moe_imbalance if lay.dims.ep > 1 else 1.0

    linear = attention = 0.0
    for part in info.parts:
        lin, att = _flops(lay, part, tokens, load=load)
        linear, attention = linear + lin, attention + att
    speed = peak_flops * hw.mfu * (hw.compile_speedup if lay.compile else 1.0)
    t_attention = attention / speed
    t_compute = (linear / (hw.float8_speedup if lay.float8 else 1.0)) / speed + t_attention

    _tp_collectives(col, lay, info, passes)
    _cp_collectives(col, lay, info, passes)
    _pp_collectives(col, lay, info, passes)
    ep_collectives(col, lay, info, passes, load)
    unsharded = sum(p.unsharded_params for p in info.parts)
    local = sum(p.local_params for p in info.parts)
    own_units = sum(sum(p.block_expert_params) + sum(p.block_moe_params) for p in info.parts)
    units = _fsdp_collectives(col, lay, info, unsharded - own_units,
                              local - sum(p.local_expert_params + p.local_moe_params for p in info.parts))
    units += expert_fsdp_collectives(col, lay, info) + moe_fsdp_collectives(col, lay, info)

    t_dp = sum(col.seconds(g) for g in ("fsdp", "hsdp", "efsdp", "ehsdp", "mfsdp", "mhsdp"))
    # The token dispatch and combine block the compute that needs them, like TP's collectives.
    t_mb = (t_compute + (col.seconds("tp") + col.seconds("pp") + col.seconds("ep")) / passes
            + max(0.0, col.seconds("cp") / passes - t_attention))
    # FSDP traffic hides behind compute except the first gather and the last reduce-scatter of the step.
    dp_exposed = max(0.0, t_dp - t_compute * passes) + t_dp / max(units, 1)

    memory = rank_memory(lay, info, unsharded, load)
    return {"rank": info.rank, "pp_rank": info.pp_rank, "coordinate": info.coordinate,
            "stages": [p.stage for p in info.parts], "layers": [p.layers for p in info.parts],
            "local_params": local, "unsharded_params": unsharded, "memory_bytes": memory,
            "memory_gib": sum(memory.values()) / GIB, "fits": sum(memory.values()) <= hw.memory_gib * GIB,
            "model_flops_per_microbatch": sum(sum(_flops(lay, p, tokens, recompute=False)) for p in info.parts),
            "compute_s_per_microbatch": t_compute, "microbatch_s": t_mb, "dp_exposed_s": dp_exposed,
            "all_to_all_bytes": {where: sum(r[f"{where}_bytes"] for r in col.rows if r["op"] == "all_to_all")
                                 for where in ("intra_node", "inter_node")},
            "collectives": col.rows}


def step_estimate(lay: Layout, ranks: list[dict], peak_flops: float, flops_per_token: float) -> dict:
    """Synchronous step: the slowest pipeline rank sets the pace for every microbatch, plus the bubble and the
    exposed data-parallel traffic."""
    dims = lay.dims
    v = stages_per_rank(lay.schedule)
    t_mb = max(r["microbatch_s"] for r in ranks)
    bubble = BUBBLE_FACTOR.get(lay.schedule, 1.0) * (dims.pp - 1) / v
    step = lay.accum * (lay.microbatches + bubble) * t_mb + max(r["dp_exposed_s"] for r in ranks)
    global_tokens = lay.local_batch * dims.dp_degree * lay.accum * lay.seq_len
    tps = global_tokens / step / dims.world_size
    return {"step_s": step, "tokens_per_s_per_gpu": tps, "bubble_microbatches": bubble * lay.accum,
            "mfu": tps * flops_per_token / peak_flops, "global_batch": global_tokens // lay.seq_len}
