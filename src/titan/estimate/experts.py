"""Mixture of experts in the step-time model (titan.distributed.expert_parallel): the all-to-alls that carry each MoE
block's token copies to their experts' ranks and back over the expert group (dp_shard_in_ep x cp x tp), the routed
experts' own FSDP units over the data-parallel ranks outside the expert group (dp_shard_mod_ep, with dp_replicate as
HSDP), and under tensor parallel the MoE layers' own FSDP units over the data-parallel and TP ranks
(dp_shard_cp_tp): each TP rank routes its own sequence shard, so a MoE layer has no TP collective and its gradients
are averaged over TP like a data-parallel rank's; its expert-parallel experts are on one TP rank each.

Routing is balanced unless `--estimate.moe_imbalance` says otherwise: an input, the busiest expert-parallel rank's
routed token copies over the mean. That rank receives and computes that many more copies, and the step waits for it.
"""

from __future__ import annotations


def ep_collectives(col, lay, info, passes: int, load: float) -> None:
    """Adds the dispatch and combine all-to-alls (group "ep") of every MoE block of `info`'s stages, as the busiest
    rank (`load` x the mean copies) sees them."""
    dims = lay.dims
    blocks = sum(sum(p.block_moe) for p in info.parts)
    if dims.ep == 1 or not blocks:
        return
    moe = lay.args.moe_args
    # Recomputing a block repeats its forward's dispatch and combine under full checkpointing (the op policy saves
    # the all-to-alls); which blocks are checkpointed is not read back, only how many.
    redone = sum(sum(p.block_moe) * p.full_ac_blocks / max(len(p.layers), 1) for p in info.parts)
    # Forward: dispatch and combine; backward: their gradients, the same sizes the other way. Each TP rank
    # dispatches its own sequence shard. An all-to-all lasts as long as the largest share a rank sends or receives:
    # the busiest rank receives `load` x the mean in the dispatch and sends it back in the combine.
    copies = load * lay.local_tokens / dims.tp * moe.top_k * lay.args.dim * lay.param_bytes
    innermost = "tp" if dims.tp > 1 else "cp" if dims.cp > 1 else "dp_shard_in_ep"
    col.add_all_to_all("ep", innermost, dims.ep, (4 * blocks + 2 * redone) * passes, copies)
    # Before each dispatch the ranks swap how many copies go to each expert (int64).
    col.add_all_to_all("ep", innermost, dims.ep, (blocks + redone) * passes, 8 * moe.num_experts)


def _gather_rounds(lay) -> tuple[int, int]:
    """(rounds, gathers per round) of a unit resharded as the blocks are, except that none stays gathered between
    forward and backward."""
    rounds = lay.accum * (lay.microbatches if lay.dims.pp_enabled and lay.reshard_after_forward else 1)
    return rounds, 2 if lay.reshard_after_forward else 1


def expert_fsdp_collectives(col, lay, info) -> int:
    """Adds the traffic of the experts' own FSDP units (groups "efsdp", "ehsdp"); returns how many units
    communicate."""
    dims = lay.dims
    units = [u for p in info.parts for u in p.block_expert_params if u]
    shard = dims.dp_shard * dims.cp * dims.tp // dims.ep
    if not units or shard * dims.dp_replicate == 1:
        return 0  # no expert parallel, or the experts stay whole on their ranks
    syncs = (lay.accum if dims.pp_enabled else 1) * len(units)
    local = sum(p.local_expert_params for p in info.parts)
    if shard > 1:  # HSDP with dp_replicate
        inner, size, replicas = "dp_shard_mod_ep", shard, dims.dp_replicate
    else:  # sharded over the replicas
        inner, size, replicas = "dp_replicate", dims.dp_replicate, 1
    rounds, passes = _gather_rounds(lay)
    col.add("efsdp", inner, size, "all_gather", rounds * passes * len(units), sum(units) * lay.param_bytes / len(units),
            True)
    col.add("efsdp", inner, size, "reduce_scatter", syncs, sum(units) * lay.reduce_bytes / len(units), True)
    col.add("ehsdp", "dp_replicate", replicas, "all_reduce", syncs, local * lay.reduce_bytes / len(units), True)
    return len(units)


def moe_fsdp_collectives(col, lay, info) -> int:
    """Adds the traffic of the MoE layers' own FSDP units under tensor parallel (groups "mfsdp", "mhsdp"): gathered
    and reduce-scattered over the data-parallel x TP ranks, all-reduced over dp_replicate (HSDP); returns how many
    units."""
    dims = lay.dims
    units = [u for p in info.parts for u in p.block_moe_params if u]
    if not units:
        return 0
    # Without data parallel elsewhere the forward autocasts and these units gather and reduce in fp32.
    sharded = dims.fsdp_enabled or dims.dp_replicate_enabled
    param_bytes, reduce_bytes = (lay.param_bytes, lay.reduce_bytes) if sharded else (4, 4)
    shard = dims.dp_shard * dims.cp * dims.tp
    rounds, passes = _gather_rounds(lay)
    syncs = (lay.accum if dims.pp_enabled else 1) * len(units)
    col.add("mfsdp", "tp", shard, "all_gather", rounds * passes * len(units), sum(units) * param_bytes / len(units),
            True)
    col.add("mfsdp", "tp", shard, "reduce_scatter", syncs, sum(units) * reduce_bytes / len(units), True)
    local = sum(p.local_moe_params for p in info.parts)
    col.add("mhsdp", "dp_replicate", dims.dp_replicate, "all_reduce", syncs, local * reduce_bytes / len(units), True)
    return len(units)
