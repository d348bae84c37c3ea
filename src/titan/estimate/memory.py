"""Memory of one rank: parameters, gradients and optimizer states of its shard, the FSDP units gathered around it,
gradient buffers, activations kept for backward (by pipeline schedule and activation checkpointing) and the loss's
logits, from what the dry run read back (titan.estimate.layout) and the model's shapes."""

from __future__ import annotations

from titan.distributed.pipeline import stages_per_rank
from titan.estimate.blocks import block_activation_elems
from titan.estimate.layout import Layout, RankInfo

# Optimizer state elements per parameter element (fp32).
OPTIMIZER_STATES = {"AdamW": 2, "Adam": 2, "SGD": 1}


def rank_memory(lay: Layout, info: RankInfo, unsharded: int, load: float) -> dict[str, float]:
    """Bytes per kind; `unsharded`: the rank's parameters whole; `load`: the busiest EP rank's copies over the mean."""
    states = OPTIMIZER_STATES[lay.optimizer] if lay.optimizer != "SGD" or lay.momentum > 0 else 0
    master = sum(p.local_param_bytes for p in info.parts)
    gathered, grad_buffers = _gathered_params(lay, info, unsharded)
    activations, working, logits = _activations(lay, info, load)
    return {"params": master, "grads": master, "optimizer": states * master, "gathered_params": gathered,
            "grad_buffers": grad_buffers, "activations": activations, "recompute_working_set": working,
            "logits": logits}


def _gathered_params(lay: Layout, info: RankInfo, unsharded: int) -> tuple[float, float]:
    """Bytes of the FSDP units gathered at the peak, and of the unsharded gradient buffers."""
    dims, t = lay.dims, lay.dims.tp
    experts = [u for p in info.parts for u in p.block_expert_params]
    moe_units = [u for p in info.parts for u in p.block_moe_params]
    max_unit = max([u for p in info.parts for u in p.block_params] + experts + moe_units
                   + [p.root_params for p in info.parts])
    max_block = max(u for p in info.parts for u in p.block_params)
    root = sum(p.root_params for p in info.parts)
    sharded = dims.fsdp_enabled or dims.dp_replicate_enabled
    # Without resharding (PP's default) everything stays gathered from forward to backward. Otherwise the root
    # unit (embedding, output) stays gathered around the whole pass and two blocks are live (one prefetched), and
    # as many units of the MoE layers (theirs under TP, the experts' under expert parallel unless no rank is left
    # to shard them over: the expert group holds every cp and TP rank).
    resident = sum(experts) if dims.dp_shard * dims.cp * t // dims.ep * dims.dp_replicate == 1 else 0
    # Without data parallel elsewhere the MoE layers' units (TP) gather in fp32 and the forward autocasts.
    moe_bytes = lay.param_bytes if sharded else 4
    if lay.reshard_after_forward:
        live = root + 2 * max_block + (2 * max(experts, default=0) if not resident else 0)
        gathered = (live * lay.param_bytes if sharded else 0) + 2 * max(moe_units, default=0) * moe_bytes
    else:
        blocks = unsharded - resident - sum(moe_units)
        gathered = (blocks * lay.param_bytes if sharded else 0) + sum(moe_units) * moe_bytes
    # Resident experts are cast to the compute dtype in each forward, and the copies kept for backward.
    gathered += resident * lay.param_bytes if lay.param_bytes < 4 else 0
    # Without a gradient sync every microbatch (accumulation, or PP microbatches) FSDP keeps unsharded gradients.
    accumulates = sharded and (lay.accum > 1 or lay.microbatches > 1)
    grad_buffers = unsharded * lay.reduce_bytes if accumulates else max_unit * (lay.param_bytes + lay.reduce_bytes)
    return gathered, grad_buffers


def _activations(lay: Layout, info: RankInfo, load: float) -> tuple[float, float, float]:
    """Bytes of the activations kept for backward (microbatches in flight), of one block's recompute, of logits."""
    a, dims, t, tokens = lay.args, lay.dims, lay.dims.tp, lay.local_tokens

    def part_activations(part) -> float:
        n = len(part.layers)
        if not n:
            return 0.0
        # Which blocks are checkpointed is not read back, only how many: each block counts in those shares.
        shares = {"full": part.full_ac_blocks / n, "op": part.op_ac_blocks / n}
        shares["none"] = 1 - shares["full"] - shares["op"]
        elems = sum(share * block_activation_elems(a, t, kind, moe, load) for moe in part.block_moe
                    for kind, share in shares.items() if share)
        elems += a.dim / t if part.has_embedding else 0
        elems += (a.dim / t + a.dim) if part.has_output else 0
        return elems * tokens * lay.param_bytes

    p, m, r, v = dims.pp, lay.microbatches, info.pp_rank, stages_per_rank(lay.schedule)
    if not dims.pp_enabled:
        in_flight = 1.0
    elif lay.schedule in ("GPipe", "LoopedBFS"):
        in_flight = m
    elif lay.schedule == "1F1B":
        in_flight = min(m, p - r)
    else:
        # Interleaved warm-up: (v-1)p + 2(p-1-r) + 1 chunks in flight, each chunk one of the rank's v stages.
        in_flight = min(m * v, (v - 1) * p + 2 * (p - 1 - r) + 1) / v
    activations = in_flight * sum(part_activations(q) for q in info.parts)
    recompute = any(q.full_ac_blocks or q.op_ac_blocks for q in info.parts)
    working = (max(block_activation_elems(a, t, "none", moe, load) for q in info.parts for moe in q.block_moe)
               * tokens * lay.param_bytes if recompute else 0.0)
    # The loss upcasts the (vocabulary-sharded) logits to fp32 and keeps their gradient.
    logits = (tokens * a.vocab_size / t * (lay.param_bytes + 8)
              if any(q.has_output for q in info.parts) else 0.0)
    return activations, working, logits
