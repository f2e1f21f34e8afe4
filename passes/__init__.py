"""Rewrite passes: the traced single-device graph + a Plan -> this rank's program.

Each pass is one file with one ``run(gm, plan, mesh) -> gm``; its docstring says what it requires and ensures.
They run in the order of ``PASSES``, a literal list. The passes act; they never decide: every layout, every
collective and every scale factor comes from the Plan.
"""

from __future__ import annotations

import copy

import torch.fx as fx

from passes import (causal_offsets, check_local, grad_sync, insert_collectives, localize_shapes, mixed_precision, output_adapter, recompute,
                    reseed_random, split_stages, zero)

PASSES = [
    insert_collectives.run,  # redistributions between producers and consumers, as the plan priced them
    zero.run,  # ZeRO-sharded parameters stored as flat shards, gathered where they are used
    grad_sync.run,  # gradient all-reduce of parameters replicated over an axis
    mixed_precision.run,  # parameters read in the compute dtype (those zero and grad_sync read, by them)
    localize_shapes.run,  # shape arguments rewritten from global to local
    output_adapter.run,  # outputs handed to the user as a rank's share; gradients seeded to match
    check_local.run,  # every local shape matches the plan (fails loudly, before any collective runs)
    split_stages.run,  # with a pipeline: the program cut into its stages, each a GraphModule
    causal_offsets.run,  # causal attention over split queries: each rank's mask offset by its first row
    reseed_random.run,  # random ops (dropout) drawn per shard: replicas alike, shards independent
    recompute.run,  # recomputed blocks moved into checkpointed submodules (of each stage, with a pipeline)
]


def run_all(gm: fx.GraphModule, plan, mesh) -> fx.GraphModule:
    gm = copy.deepcopy(gm)
    for p in PASSES:
        gm = p(gm, plan, mesh)
    gm.graph.lint()
    gm.recompile()
    return gm
