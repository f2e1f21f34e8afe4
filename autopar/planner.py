"""Planner: traced graph + mesh + constraints -> Plan (strategies -> cost -> solve -> price).

In: a TracedGraph, a Mesh, an optional memory budget (bytes per device) and pins.
Out: a ``Plan`` whose every number is recomputed from the chosen strategies on the whole (untied) graph: node
times and memory, and every collective of a training step, each redistribution emitted once per (producer,
destination Spec) exactly as ``passes/insert_collectives.py`` will emit it.
"""

from __future__ import annotations

import math
import operator
import time

import torch

from autopar.cost import (ATTENTION_OPS, MATMUL_OPS, RECOMPUTE, VIEW_OPS, CostModel, Priced, collective_time, itemsize, op_flops, peak_memory,
                          price_steps, step_temporaries, step_time, wire_bytes)
from autopar.mesh import Mesh
from autopar.plan import Collective, GradBucket, NodePlan, Plan, PlanCost, ZeroBucket
from autopar.redistribute import Step
from autopar.errors import AutoparError
from autopar.solver import (FOLDED, FOLLOWER, Choice, Pin, Problem, _storage_root, block_backward_peak, block_kept, build_problem, gc_paused, held_output, kept_values, loss_gradient_bytes, loss_gradients,
                            solve, tail_nodes, zero_groups)
from autopar.zero import (ZeroOption, bucket_latency, effective, frozen, gather_priced, grad_bucket, weight_users, param_cost,
                          regathered_for_recompute, scatter_priced, shard_factor, zero3_uses)
from autopar.spec import Partial, Shard, Spec
from autopar.strategies import op_info, tensor_inputs
from autopar.trace import INPUT, PARAM, TracedGraph

N_ALTERNATIVES = 6


def cost_model(tg: TracedGraph, mesh: Mesh, recompute: str = "none") -> CostModel:
    """The cost model of ``tg`` on ``mesh`` with activation recomputation ``recompute`` (none / selective / full)
    applied to the nodes of its repeated blocks; each block's inputs and outputs stay kept (recomputation starts from
    them, and a recomputed block does not bring its outputs back).
    Under ``selective`` on a runtime that recomputes every k-th matmul of a block too
    (``Hardware.selective_recomputes_every``), those matmuls are priced as recomputed. On a runtime that runs the
    blocks' linears in float8 (``Hardware.float8_linears``), the blocks' matmuls with a weight operand are priced so
    (attention's matmuls of activations stay in the model's dtype, as torchao's Float8Linear leaves them)."""
    if recompute not in RECOMPUTE:
        raise AutoparError(f"recompute={recompute!r} is not one of {', '.join(RECOMPUTE)}")
    nodes = tg.nodes

    def linear(n: str) -> bool:  # a matmul with a parameter operand (through its views)
        return nodes[n].target in MATMUL_OPS and any(tg.kinds.get(_storage_root(a).name) == PARAM for a in nodes[n].all_input_nodes)

    float8 = frozenset()
    if mesh.hardware.float8_linears:  # the blocks' linears (torchtitan leaves the output head in bf16)
        float8 = frozenset(n for b in tg.blocks for n in b.nodes if linear(n))
    linears = frozenset(n for n in nodes if linear(n)) if mesh.hardware.tp_overlap else frozenset()
    fused = _fusion(tg) if mesh.hardware.fused_elementwise else None
    # each float8 linear's input operand (``addmm``'s first input is its bias)
    casts = frozenset(tensor_inputs(nodes[n])[int(nodes[n].target is torch.ops.aten.addmm.default)].name for n in float8)
    if recompute == "none" or not tg.blocks:
        return CostModel(mesh, float8=float8, linears=linears, fused=fused, casts=casts)
    every = mesh.hardware.selective_recomputes_every if recompute == "selective" else 0
    modes, kept = {}, set()
    for b in tg.blocks:
        inside = set(b.nodes)
        k = 0
        for name in b.nodes:
            modes[name] = recompute
            if every and nodes[name].target in MATMUL_OPS:  # the policy counts a block's matmuls in program order
                k += 1
                if k % every == 0:
                    modes[name] = "recomputed"  # this matmul runs again instead of being kept (its inputs' collectives do not)
            for a in nodes[name].all_input_nodes:
                if a.name not in inside and a.op == "call_function":
                    kept.add(_storage_root(a).name)
            if any(user.name not in inside for user in nodes[name].users):
                # the block's output: the next block's input, or what the head reads (and keeps) -- recomputation
                # of this block does not bring it back. Counting it here, not only as the next block's input, keeps
                # it with its own block, which the cluster's one-block proxy repeats L times
                kept.add(_storage_root(nodes[name]).name)
    return CostModel(mesh, modes, frozenset(kept), float8, linears, fused, casts)


def _fusion(tg: TracedGraph) -> dict[str, tuple[frozenset, bool]]:
    """What torch.compile's fusion of memory-bound ops spares each one in the repeated blocks (``CostModel.fused``):
    a block's memory-bound ops (not a matmul, attention or view) joined through views form chains that run as one
    kernel; an op reads in registers the inputs another op of its chain produced, and its output stays in registers
    when every consumer (through views) is in its chain. Compiled block by block, as torchtitan does: nothing fuses
    across a block's boundary, nor into a matmul or attention (their operands are written to memory)."""
    nodes = tg.nodes
    heavy = MATMUL_OPS | ATTENTION_OPS
    views = VIEW_OPS | {operator.getitem}

    def through_views(a):
        while a.op == "call_function" and a.target in views and a.args:
            a = a.args[0]
        return a

    def consumers(n):
        for u in n.users:
            if u.op == "call_function" and u.target in views:
                yield from consumers(u)
            else:
                yield u

    out: dict[str, tuple[frozenset, bool]] = {}
    for b in tg.blocks:
        inside = set(b.nodes)

        def elementwise(n) -> bool:
            return n.name in inside and n.op == "call_function" and n.target not in heavy and n.target not in views

        for name in b.nodes:
            n = nodes[name]
            if not elementwise(n):
                continue
            free = frozenset(i for i, a in enumerate(tensor_inputs(n)) if elementwise(through_views(a)))
            users = list(consumers(n))
            alone = bool(users) and all(elementwise(u) for u in users)
            if free or alone:
                out[name] = (free, alone)
    return out


@gc_paused
def make_plan(tg: TracedGraph, mesh: Mesh, memory_budget: float | None = None, pins: list[Pin] | None = None,
              recompute: str = "none", likely_fits: bool = False) -> Plan:
    """``likely_fits``: the caller has estimated the plan's peak well under the budget (the cluster screen), so the
    solver skips its infeasibility pre-check (two memory solves); an infeasible budget is still found and
    explained, only more slowly."""
    t0 = time.perf_counter()
    cost = cost_model(tg, mesh, recompute)
    problem = build_problem(tg, mesh, cost)
    budget = mesh.hardware.memory if memory_budget is None else float(memory_budget)
    choice = solve(tg, mesh, cost, problem, budget, list(pins or []), floor=not likely_fits)
    t1 = time.perf_counter()
    plan = price(tg, mesh, problem, choice, cost)
    plan.recompute = recompute
    build = problem.timings.get("ilp build", 0.0)
    plan.timings = {"strategies+cost": problem.timings.get("strategies", 0.0), "ilp build": build,
                    "solve": problem.timings.get("solve", 0.0) - build,
                    "price": time.perf_counter() - t1, "ilp variables": problem.timings.get("ilp_size", 0.0)}
    plan.timings["plan total"] = time.perf_counter() - t0
    return plan


def _op_name(tg: TracedGraph, n) -> str:
    if n.op == "placeholder":
        return tg.kinds[n.name]
    return str(n.target)


def price(tg: TracedGraph, mesh: Mesh, problem: Problem, choice: Choice, cost: CostModel) -> Plan:
    strategy = choice.strategy
    nodes_fx = tg.nodes
    # every collective of one step: redistributions (one per producer and destination Spec), grad syncs, outputs
    collectives: list[Collective] = []
    emitted: dict[tuple[str, str], str] = {}
    edge_seconds: dict[str, float] = {}  # consumer -> seconds of the redistributions it caused

    def add(priced: list[Priced], where: str):
        for p in priced:
            collectives.append(Collective(p.kind, p.axis, p.bytes, p.phase, where, p.seconds))

    for u, v, i, m in problem.edges:
        src, dst = strategy[u].output, strategy[v].inputs[i]
        if src == dst or (u, str(dst)) in emitted:
            continue
        emitted[(u, str(dst))] = v
        pr = cost.edge_priced(m, src, dst, problem.requires_grad.get(u, False), v, u)
        add(pr, f"{v} <- {u}")
        edge_seconds[v] = edge_seconds.get(v, 0.0) + sum(p.seconds for p in pr)
    owned = 0.0  # what ops send inside themselves (a balanced causal attention's swaps): in their time, listed here
    for name in problem.order:
        n = nodes_fx[name]
        if n.op == "call_function" and n.target in ATTENTION_OPS:
            pr = cost.op_priced(op_info(n), strategy[name], problem.requires_grad.get(name, False), name)
            add(pr, name)
            owned += sum(p.seconds for p in pr)
    # parameters: gradient all-reduce buckets (ZeRO-0, and ZeRO-3 shards over the axes they do not shard) and
    # ZeRO buckets (ZeRO-1/2: gathered at the start of forward, reduce-scattered in backward; ZeRO-3: per use)
    zgroups = zero_groups(tg, problem.order)
    state = grad = 0.0
    act = sum(kb for _, kb in kept_values(problem, strategy, cost).values())  # redistributed values backward keeps
    # and the outputs the caller holds into backward (a model's logits, read by a loss computed outside it)
    held = sum(held_output(problem, k, spec, mesh.sizes) for k, spec in enumerate(choice.output_specs))
    act += held
    # one-at-a-time buffers of the gradient peak, and of the activation peak: the caller's loss starts backward with
    # two gradients of what it read (a cross-entropy's: of its log-probabilities and of the logits, as the graph's
    # own loss does, ``solver.loss_gradients``; left out, a GPT's logits handed out peaked at twice their price)
    transient, t_act = 0.0, 2 * held
    busy_time = 0.0  # memory-bound work on the compute stream: the runtime's copies around gradient and parameter
    # communication, and the optimizer's step (``ZeroCost.memory_bound``)
    optimizer_time = 0.0  # the step alone, as the plan reports it
    group_memory: dict[str, list] = {}  # group -> [bytes held, gradient bytes, parameters]
    by_zero: dict[tuple, list[str]] = {}
    buckets: dict[tuple[str, tuple[int, ...]], list[tuple[str, int]]] = {}  # -> [(param, bytes to all-reduce)]
    zero_of: dict[str, ZeroOption] = {}
    param_rows: dict[str, tuple[float, float]] = {}  # a parameter's (time, memory) under its ZeRO stage, for its row
    param_zc: dict[str, object] = {}  # a parameter's ZeroCost under its ZeRO stage
    whole_grads: dict[str, tuple[str, ...]] = {}
    stepped: list[float] = []  # what the optimizer steps of each parameter, in the order it steps them

    def zero_cost(name: str, strategy_of) -> tuple:
        """A parameter's (gradient Spec, frozen, ZeRO option, ZeroCost) under its group's ZeRO stage, the
        strategies given by ``strategy_of`` (the solver's options price parameters at ZeRO-0)."""
        spec = problem.grad_spec(name, strategy_of)  # whole where its gradient is
        uses = zero3_uses(tg, name, problem.zero3_kept)
        cold = frozen(uses)  # no gradient: ZeRO-3 shards it, nothing else touches it
        opt = effective(choice.zero.get(zgroups[name][0], ZeroOption(0)), spec, mesh, cold)
        return spec, cold, opt, param_cost(opt, spec, problem.meta[name], mesh, uses=uses)

    at_act = [False]  # the step's peak is the activations' (as backward starts), not the gradients' (as it ends)

    def row(zc) -> tuple[float, float]:
        return zc.memory_bound + zc.comm, zc.state + (zc.act if at_act[0] else zc.grad)

    def bucket_key(name: str, opt: ZeroOption, spec, cold: bool) -> tuple:
        """The key of the bucket a parameter's gradients land in (None: none) -- the key ``by_zero`` (ZeRO-1/2) or
        ``buckets`` files it under, and explain's pricing compares -- and that bucket's launch and latency seconds
        (``bucket_latency``: paid once per bucket)."""
        gb = grad_bucket(opt, spec, problem.meta[name], mesh, cold)
        block = tg.block_of(name) or ""
        if gb is None:
            return None, 0.0
        if gb[0].stage in (1, 2):
            return (gb[0].stage, gb[0].shard_axes, gb[1], block if gb[0].stage == 2 else ""), bucket_latency(mesh, gb[1], gb[0])
        return (block, gb[1]), bucket_latency(mesh, gb[1])

    bucket_of: dict[str, tuple] = {}  # parameter -> (its bucket's key, that bucket's latency): ``bucket_key``

    for name in problem.order:
        if name not in zgroups:
            continue
        g = zgroups[name][0]
        spec, cold, opt, zc = zero_cost(name, strategy.__getitem__)
        meta, stored = problem.meta[name], strategy[name].output
        if spec != stored and not cold:
            whole_grads[name] = tuple(mesh.names[a] for a in range(mesh.ndim) if spec[a] != stored[a])
        zero_of[name] = opt
        param_zc[name] = zc
        if zc.stepped:
            stepped.append(zc.stepped)
        busy_time += zc.memory_bound
        optimizer_time += zc.optimizer
        gm = group_memory.setdefault(g, [0.0, 0.0, 0])
        gm[0] += zc.state
        gm[1] += zc.grad
        gm[2] += 1
        state += zc.state - problem.costs[name][choice.index[name]].state
        grad += zc.grad - problem.costs[name][choice.index[name]].grad
        act += zc.act - problem.costs[name][choice.index[name]].act
        local = math.prod(spec.local_shape(meta.shape, mesh.sizes)) * itemsize(meta.dtype)
        n = shard_factor(opt, mesh)
        # the bucket its gradients land in, as the solver prices them; the explain pricing below keys them alike
        bucket_of[name] = bucket_key(name, opt, spec, cold)
        key = bucket_of[name][0]
        if key is not None and opt.stage in (1, 2):
            by_zero.setdefault(key, []).append(name)
        elif key is not None:
            buckets.setdefault(key, []).append((name, int(local // n * mesh.hardware.reduce_factor(meta.dtype))))
    # the optimizer's step, after backward: the gradients a rank stores and its temporaries beside the state
    temps = step_temporaries(stepped, mesh.hardware.optimizer_kernel)
    grad_buckets = []
    later = {b.fqn for b in tg.blocks[1:]}  # blocks whose buckets' last reductions backward has work left to hide
    hide_buckets = set()  # (``cost.step_time``): their last collective is H
    for (block, axes), members in buckets.items():
        bname = f"grads[{block or 'rest'}]({','.join(mesh.names[a] for a in axes)})"
        if block in later and all(zero_of[n].stage == 0 for n, _ in members):
            hide_buckets.add(bname)
        grad_buckets.append(GradBucket(bname, tuple(mesh.names[a] for a in axes), tuple(n for n, _ in members)))
        nbytes = sum(b for _, b in members)
        # the bucket's flat copy, then the gradients cut from it (each in its own storage: ``collectives._own``) beside
        # it; the gradients it was made of are gone by then: one bucket's bytes over the gradients (measured,
        # ``benchmarks/zero_memory.py``: 2x put ZeRO-0's peak 6% over)
        transient = max(transient, nbytes)
        for a in axes:
            add([Priced("all_reduce", mesh.names[a], nbytes, "backward", collective_time("all_reduce", nbytes, mesh.sizes[a], mesh.link(a)))], bname)
    zero_buckets = []
    for (stage, shard_axes, rest, block), members in by_zero.items():
        zname = f"zero{stage}[{block or 'all' if stage == 1 else block or 'rest'}]({','.join(mesh.names[a] for a in shard_axes)})"
        if rest:
            zname += f"+ar({','.join(mesh.names[a] for a in rest)})"
        full = sum(math.prod(strategy[n].output.local_shape(problem.meta[n].shape, mesh.sizes)) * itemsize(problem.meta[n].dtype) for n in members)
        zero_buckets.append(ZeroBucket(zname, stage, tuple(mesh.names[a] for a in shard_axes), tuple(mesh.names[a] for a in rest), tuple(members)))
        if stage == 2 and block in later:
            hide_buckets.add(zname)
        add(gather_priced(full, shard_axes, mesh, "forward") + scatter_priced(full, shard_axes, rest, mesh, problem.meta[members[0]].dtype), zname)
        if stage == 2:  # a bucket's full gradients (their flat copy, in the reduce dtype): beside the other buckets'
            # gathered parameters as backward starts, and beside the gradients as it ends
            rf = mesh.hardware.reduce_factor(problem.meta[members[0]].dtype)
            transient = max(transient, full * rf)
            t_act = max(t_act, full * rf)
    # one block's backward at its peak, op by op, with the gradients flowing through it, as the solver bounds it
    # (blocks are tied: the first stands for all)
    regen = block_backward_peak(problem, choice.index.__getitem__, mesh.sizes) if problem.block_steps else 0.0
    # ZeRO-3: the runtime gathers a block's parameters (or the rest) as one bucket (``passes/zero.py``): for forward,
    # the linears' weights again for backward (``zero.zero3_traffic``; a recomputed block's as its backward starts,
    # for its recomputation to read and keep), all gradients reduce-scattered together. A bucket with linears both in
    # and out of recomputed blocks keeps its weights from forward to backward instead ("keep"), and so does the one
    # holding the output head (``zero.kept_to_backward``)
    # A frozen parameter is gathered like the others and reduces nothing; a linear taking a frozen weight whose
    # input needs no gradient has no backward: a bucket whose linears are all such ("forward": a frozen first layer)
    # is gathered for forward alone
    per_block: dict[tuple, list] = {}  # (block, shard axes) -> [(name, bytes), bytes used by linears, linear users
    # with a backward, bytes with a gradient]
    for name, opt in zero_of.items():
        if opt.stage != 3:
            continue
        spec, meta = strategy[name].output, problem.meta[name]
        full = math.prod(spec.local_shape(meta.shape, mesh.sizes)) * itemsize(meta.dtype)
        block = tg.block_of(name) or "rest"
        acc = per_block.setdefault((block, opt.shard_axes), [[], 0.0, [], 0.0])
        linears = [u.name for u in weight_users(nodes_fx[name])]
        acc[0].append((name, full))
        acc[1] += full * bool(linears)
        acc[2] += [u for u in linears if problem.requires_grad.get(u)]
        acc[3] += full * (name in tg.trainable)
    # backward prefetch (``ZeroBucket.prefetch``): a bucket gathered again in backward launches the gather of the
    # bucket forward dropped just before it (after its last linear) if that is another copy of its block, whose
    # weights join its own and its gradients
    position = {n: i for i, n in enumerate(nodes_fx)}  # graph order
    weights_of = {}
    for key, (members, linear_b, users, _g) in per_block.items():
        again = [u in cost.recompute for u in users]
        kept = any("kept" in zero3_uses(tg, n) for n, _ in members)  # the head's: forward's last linear weight
        weights_of[key] = ("recompute" if regathered_for_recompute(users, cost.recompute) else "keep" if any(again) or kept
                           else "forward" if linear_b and not users else "regather")
    dropped = sorted((max(position[u] for u in users), key) for key, (_m, _b, users, _g) in per_block.items()
                     if users and weights_of[key] != "keep")
    zname_of = {key: f"zero3[{key[0]}]({','.join(mesh.names[a] for a in key[1])})" for key in per_block}
    group_of = {key: zgroups[members[0][0]][0] for key, (members, _b, _u, _g) in per_block.items()}
    before_of = {key: before for (_p, before), (_q, key) in zip(dropped, dropped[1:]) if group_of[before] == group_of[key]}
    for (block, shard_axes), (members, linear_b, users, grad_b) in per_block.items():
        zname = zname_of[block, shard_axes]
        weights = weights_of[block, shard_axes]
        before = before_of.get((block, shard_axes))
        zero_buckets.append(ZeroBucket(zname, 3, tuple(mesh.names[a] for a in shard_axes), (), tuple(n for n, _ in members), weights,
                                       zname_of[before] if before else ""))
        all_b = sum(b for _, b in members)
        priced = list(gather_priced(all_b, shard_axes, mesh, "forward"))
        if linear_b and weights not in ("keep", "forward"):
            priced += gather_priced(linear_b, shard_axes, mesh, "backward")
        trainable = [n for n, _ in members if n in tg.trainable]
        if trainable:
            priced += scatter_priced(grad_b, shard_axes, (), mesh, problem.meta[trainable[0]].dtype)
        add(priced, zname)
        # the bucket gathered again with its gradients, or as its gather ends the gathered rows and the parameters
        # cut from them (``zero.zero3_transient``), and the one it launches ahead: in backward the copy before's
        # weights; a bucket gathered for forward alone, the next copy's (taken as its own size)
        ahead = per_block[before][1] if before else all_b if weights == "forward" and zgroups[members[0][0]][1] > 1 else 0.0
        rf = mesh.hardware.reduce_factor(problem.meta[members[0][0]].dtype) if trainable else 1.0
        # a recomputed block's bucket is gathered again as its backward starts, and its recomputation then brings
        # its activations back beside it (left out, 13% under what a fully recomputed GPT on 2 gloo ranks held)
        back = regen if weights == "recompute" else 0.0
        transient = max(transient, (1 + max(rf, 1.0)) * all_b + ahead + back)  # gradients and their flat copy
        t_act = max(t_act, 2 * all_b + ahead + back)
    plan_in = [strategy[n].output for n in problem.order if tg.kinds.get(n) == INPUT]
    input_spec = plan_in[0] if plan_in else Spec.replicated(mesh.ndim)
    split = {a for a, p in enumerate(input_spec.placements) if isinstance(p, Shard)}
    for k, ((u, m), spec) in enumerate(zip(problem.outputs, choice.output_specs)):
        src = strategy[u].output
        rg = problem.requires_grad.get(u, False)
        if src != spec and (u, str(spec)) not in emitted:
            emitted[(u, str(spec))] = f"output{k}"
            add(cost.edge_priced(m, src, spec, rg, None, u), f"output{k} <- {u}")
        # the output adapter sums a partial output over the axes that do not split the batch
        summed = [Step("all_reduce", a, shape=m.shape) for a, p in enumerate(spec.placements) if isinstance(p, Partial) and a not in split]
        add(price_steps(summed, m.dtype, mesh, rg), f"output{k}")
    # totals
    compute = sum(problem.costs[n][choice.index[n]].compute for n in problem.order) - owned + busy_time
    comm = sum(c.seconds for c in collectives)
    # data-parallel communication (gradient buckets, ZeRO) runs beside the critical path when the runtime overlaps it
    dp_comm = sum(c.seconds for c in collectives if c.data_parallel)
    # the reductions the runtime waits for later with backward left to run: each such bucket's last collective
    last_of = {c.where: c for c in collectives if c.where in hide_buckets}
    deferred = sum(c.seconds for c in last_of.values())
    step = step_time(compute + comm - dp_comm, dp_comm, deferred, mesh.hardware)
    # a block's backward holds what it kept or recomputation brought back, with the gradients flowing through it
    # (``solver.block_backward_steps``): the last block's as backward starts, beside every kept activation less what
    # the block's ops keep (counted in them) and what the loss and the head kept (their backward has run); the first
    # block's as it ends, beside the gradients of all the blocks after it (left out, a GPT of 8 fully recomputed
    # layers peaked 13% over its price)
    tail = tail_nodes(tg, problem.order) if problem.block_steps else frozenset()
    kept = block_kept(problem, choice.index.__getitem__) if problem.block_steps else 0.0  # counted in ``act``
    t_act = max(t_act, regen - kept - sum(problem.costs[n][choice.index[n]].act for n in tail))
    transient = max(transient, regen)
    # backward starts with the loss's gradient beside every kept activation (``solver.loss_gradients``)
    t_act = max(t_act, sum(loss_gradient_bytes(loss_gradients(problem), strategy.__getitem__, mesh).values()))
    state += sum(problem.costs[n][choice.index[n]].state for n in problem.order)
    grad += sum(problem.costs[n][choice.index[n]].grad for n in problem.order)
    act += sum(problem.costs[n][choice.index[n]].act for n in problem.order)
    memory = peak_memory(state, grad, act, transient, t_act, sum(stepped) + temps)
    breakdown = {"state": state, "gradients": grad, "activations": act, "transient": max(transient, t_act)}
    if temps:  # (beside the state and the stored gradients: what the optimizer's step allocates, ``Hardware.optimizer_kernel``)
        breakdown[f"optimizer step ({mesh.hardware.optimizer_kernel})"] = temps
    comm_bytes = {a: 0.0 for a in mesh.names}
    for c in collectives:
        comm_bytes[c.axis] += wire_bytes(c.kind, c.bytes, mesh.sizes[mesh.names.index(c.axis)])
    flops, dtype = 0.0, torch.float32
    for name in problem.order:
        n = nodes_fx[name]
        if n.op == "call_function" and (n.target in MATMUL_OPS or n.target in ATTENTION_OPS):
            info = op_info(n)
            f = op_flops(n.target, [m.shape for m in info.inputs], [m.shape for m in info.outputs])
            flops += f * (3 if problem.requires_grad.get(name) else 1)
            dtype = info.outputs[0].dtype
    peak = mesh.hardware.flops(dtype) * mesh.size
    mfu = flops / (peak * step) if step > 0 else 0.0
    # a parameter's row holds what it adds at the step's peak: its state, and its gradients or what it keeps for
    # backward (ZeRO-1/2's gathered copy, a 16-bit compute copy), whichever side the peak is on (the rows summed all
    # three, past the peak itself under ZeRO-1)
    at_act[0] = act + t_act >= max(grad + transient, sum(stepped) + temps)
    for name, zc in param_zc.items():
        param_rows[name] = row(zc)
    # node records, with alternatives priced in context for representatives
    ins_of: dict[str, list] = {}
    outs_of: dict[str, list] = {}
    for u, v, i, m in problem.edges:
        ins_of.setdefault(v, []).append((u, i, m))
        outs_of.setdefault(u, []).append((v, i, m))
    copies_of: dict[str, list[str]] = {}
    for name in problem.order:
        copies_of.setdefault(problem.rep.get(name, name), []).append(name)

    members = {}  # bucket key -> how many parameters it holds
    for k, _lat in bucket_of.values():
        members[k] = members.get(k, 0) + 1

    def param_option(p: str, strategy_of, moves: list) -> tuple[float, float]:
        """A parameter's row under its ZeRO stage with the strategies ``strategy_of``; a move of its gradients to
        another bucket is noted in ``moves`` ((old key, its latency, new key, its latency): ``bucket_shift``)."""
        spec, cold, opt, zc = zero_cost(p, strategy_of)
        key, lat = bucket_key(p, opt, spec, cold)
        if key != bucket_of[p][0]:
            moves.append((*bucket_of[p], key, lat))
        return row(zc)

    def bucket_shift(moves: list) -> float:
        """The bucket latency an option's moves add: each bucket no parameter was in that they open, once, less each
        bucket all of whose parameters they take out of it, once."""
        opened = {new: lat for _o, _ol, new, lat in moves if new is not None and new not in members}
        left: dict = {}
        for old, old_lat, _n, _l in moves:
            if old is not None:
                left[old] = (left.get(old, (0, old_lat))[0] + 1, old_lat)
        return sum(opened.values()) - sum(lat for k, (n, lat) in left.items() if n == members[k])

    chosen_out = {}  # node -> [(output meta, the Spec it is handed out in)]
    for (u, m), spec in zip(problem.outputs, choice.output_specs):
        chosen_out.setdefault(u, []).append((m, spec))

    group_of: dict[str, list[str]] = {}  # a decision -> the nodes its strategy fixes: itself, followers, folded
    for name in problem.order:
        group_of.setdefault(problem.root[name], []).append(name)

    def option_price(root: str, si: int, moves: list) -> tuple[float, float]:
        """Seconds and bytes of decision ``root`` (one copy) under its option ``si``, the rest of the plan as chosen:
        its own cost and its group's -- the views and elementwise ops that follow it and the parameters folded into
        it, each in the Spec this option gives it (a parameter's row under its ZeRO stage, with the latency of a
        gradient bucket move noted in ``moves``) -- the redistributions into the group and out of it (one per source and
        Spec, as the solver prices them), and to the Specs the plan hands its outputs out in."""
        inside = set(group_of[root])

        def strat(x: str):
            return problem.strategy(x, si) if x in inside else strategy[x]

        t = mem = 0.0
        shared: dict[tuple, float] = {}

        def edge(u: str, v: str, i: int, m) -> None:
            dst = strat(v).inputs[i]
            e = cost.edge_time(m, strat(u).output, dst, problem.requires_grad.get(u, False), v, u)
            shared[u, dst] = max(shared.get((u, dst), 0.0), e)

        for n in group_of[root]:
            k = problem.index(n, si)
            nt, nm = param_option(n, strat, moves) if n in param_rows else (problem.costs[n][k].time, problem.costs[n][k].memory)
            t, mem = t + nt, mem + nm
            for u, i, m in ins_of.get(n, []):
                edge(u, n, i, m)
            for v, i, m in outs_of.get(n, []):
                if v not in inside:
                    edge(n, v, i, m)
            for m, spec in chosen_out.get(n, ()):
                t += cost.edge_time(m, strat(n).output, spec, problem.requires_grad.get(n, False), None, n)
        return t + sum(shared.values()), mem

    nodes: dict[str, NodePlan] = {}
    for name in problem.order:
        idx = choice.index[name]
        nc = problem.costs[name][idx]
        rep = problem.rep.get(name, name)
        alts: tuple = ()
        # a folded parameter (read by one op) has no choice of its own: its Spec is the one its reader's strategy
        # takes it in, and another would be another strategy of that op (its alternatives list them); priced alone
        # beside the op as chosen, it would need a redistribution the program never has
        # a follower takes its root's layout: its other Specs come only with the root's other strategies (priced
        # alone, one seemed to beat the choice where no plan could take it without changing the root too)
        follows = tg.path(problem.root[name]) if problem.kind.get(name) == FOLLOWER else ""
        if rep == name and not follows and problem.kind.get(name) != FOLDED:
            scored = []
            ok = choice.allowed.get(name)  # the options the pins leave: another would contradict them
            for si in range(len(problem.cands[name])):
                if ok is not None and si not in ok:
                    continue
                # tied copies take one strategy: each priced with its own neighbours (the first block's input
                # comes from the embedding, the others' from the block before), summed
                t = mem = 0.0
                moves: list = []  # parameters' gradients moved to other buckets, over all copies (``bucket_shift``)
                for c in copies_of.get(name, (name,)):
                    ct, cm = option_price(c, si, moves)
                    t, mem = t + ct, mem + cm
                scored.append((t + bucket_shift(moves), mem, si))
            scored.sort(key=lambda r: (r[0], r[1], r[2]))
            keep = scored[:N_ALTERNATIVES]
            if idx not in [r[2] for r in keep]:
                keep.append(next(r for r in scored if r[2] == idx))
            alts = tuple((str(problem.cands[name][si]), t, mem) for t, mem, si in keep)
        n = nodes_fx[name]
        t, mem = param_rows.get(name, (nc.time, nc.memory))  # (the solver's options price a parameter at ZeRO-0)
        nodes[name] = NodePlan(name, tg.path(name), _op_name(tg, n), problem.meta[name].shape, strategy[name], t, mem, rep, alts, follows)
    return Plan(
        mesh=mesh,
        graph_hash=tg.hash,
        nodes=nodes,
        input_spec=input_spec,
        output_specs=list(choice.output_specs),
        blocks=[(b.fqn, b.tied_to) for b in tg.blocks],
        collective_list=collectives,
        grad_buckets=grad_buckets,
        cost=PlanCost(step, mfu, memory, comm_bytes, compute, comm, flops, breakdown, optimizer_time),
        zero_buckets=zero_buckets,
        whole_grads=whole_grads,
        zero_stages={g: opt.to_json(mesh) for g, opt in choice.zero.items()},
        group_memory=group_memory,
        solver_status=choice.status,
    )
