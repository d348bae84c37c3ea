"""Expert parallel in the step-time model (titan.distributed.expert_parallel): the all-to-alls that carry each MoE
block's token copies to their experts' ranks and back, and the routed experts' own FSDP units over the
data-parallel ranks outside the expert group (dp_shard_mod_ep, with dp_replicate as HSDP).

Routing is taken as balanced: every rank sends and receives k copies of each of its tokens, of which (ep - 1) / ep
leave it; the most loaded rank of an unbalanced step is not modelled.
"""

from __future__ import annotations


def ep_collectives(col, lay, info, passes: int) -> None:
    """Adds the dispatch and combine all-to-alls (group "ep") of every MoE block of `info`'s stages."""
    dims = lay.dims
    blocks = sum(sum(p.block_moe) for p in info.parts)
    if dims.ep == 1 or not blocks:
        return
    moe = lay.args.moe_args
    # Recomputing a block repeats its forward's dispatch and combine (the op policy saves no all-to-all); which
    # blocks are checkpointed is not read back, only how many.
    redone = sum(sum(p.block_moe) * (p.full_ac_blocks + p.op_ac_blocks) / max(len(p.layers), 1) for p in info.parts)
    # Forward: dispatch and combine; backward: their gradients, the same sizes the other way.
    copies = lay.local_tokens * moe.top_k * lay.args.dim * lay.param_bytes
    innermost = "cp" if dims.cp > 1 else "dp_shard_in_ep"
    col.add_all_to_all("ep", innermost, dims.ep, (4 * blocks + 2 * redone) * passes, copies)
    # Before each dispatch the ranks swap how many copies go to each expert (int64).
    col.add_all_to_all("ep", innermost, dims.ep, (blocks + redone) * passes, 8 * moe.num_experts)


def expert_fsdp_collectives(col, lay, info) -> int:
    """Adds the traffic of the experts' own FSDP units (groups "efsdp", "ehsdp"); returns how many units."""
    dims = lay.dims
    units = [u for p in info.parts for u in p.block_expert_params if u]
    shard = dims.dp_shard * dims.cp // dims.ep
    if not units or shard * dims.dp_replicate == 1:
        return 0  # no expert parallel, or the experts stay whole on their ranks
    inner, size = ("dp_shard_mod_ep", shard) if shard > 1 else ("dp_replicate", dims.dp_replicate)
    # As the blocks' units, except that no expert unit stays gathered between forward and backward.
    rounds = lay.accum * (lay.microbatches if dims.pp_enabled and lay.reshard_after_forward else 1)
    passes = 2 if lay.reshard_after_forward else 1
    col.add("efsdp", inner, size, "all_gather", rounds * passes * len(units),
            sum(units) * lay.param_bytes / len(units), True)
    syncs = (lay.accum if dims.pp_enabled else 1) * len(units)
    col.add("efsdp", inner, size, "reduce_scatter", syncs, sum(units) * lay.reduce_bytes / len(units), True)
    if shard > 1 and dims.dp_replicate > 1:
        local = sum(p.local_expert_params for p in info.parts)
        col.add("ehsdp", "dp_replicate", dims.dp_replicate, "all_reduce", syncs, local * lay.reduce_bytes / len(units),
                True)
    return len(units)
