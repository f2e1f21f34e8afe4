"""Hand-written strategies, expressed as Plans in the format the solver emits.

In: a model, a Mesh, one example global batch, a strategy name and the knobs published configurations use:
``microbatch_size``, ``schedule`` (gpipe / 1f1b / interleaved), ``virtual_stages``, ``sequence_parallel``,
``recompute`` (none / selective / full), ``zero`` (0-3), ``blocks_per_stage`` (a pipeline's uneven cut), and for
``explicit`` the degrees ``tp``, ``pp``, ``dp``, ``microbatches``. Degrees are read from the mesh axes (``dp...`` data axes, ``tp``).
Out: a Plan. The strategy fixes what its authors fix (every weight's layout, the ZeRO stage, the residual
stream's layout under sequence parallelism); the solver completes the rest (embeddings, loss, views) under the
same cost model, so the comparison with ``autopar.plan`` measures the choices that differ.

Strategies:
- ``ddp``: every weight whole, gradients all-reduced over the data axes (``zero`` 0 by default).
- ``fsdp``: ZeRO-3 over the data axes (``zero`` may lower the stage).
  On a mesh with a ``tp`` axis both compose with Megatron on ``tp`` (torchtitan's 2-D: "ddp+tp", "fsdp+tp"; sequence
  parallel unless ``sequence_parallel=False``, as torchtitan's TP splits the norms' sequence); on a
  mesh with a ``cp`` axis with context parallelism (torchtitan's FSDP + CP, "fsdp+cp", and with tp "fsdp+tp+cp(sp)"):
  every attention's queries split by sequence on cp, and ZeRO sharding over the data and cp axes both.
- ``megatron``: column-parallel then row-parallel projections on ``tp`` (GPT: c_attn/c_fc then c_proj; Llama,
  Mixtral: wq/wk/wv, w1/w3 then wo, w2; Mixtral's experts split along their hidden dim; Hugging Face's GPT-2,
  whose Conv1D weights are stored (in, out), and its Llama-style models: q/k/v_proj, gate/up_proj then o_proj,
  down_proj), with
  ``sequence_parallel`` the residual stream split by sequence (without, whole on tp, as Megatron-LM runs it: the
  solver's choice would be sequence parallelism where it pays); data parallel (``zero``) on the data axes.
- ``megatron-3d`` (and ``explicit`` on a mesh with pp): Megatron on tp, data parallel on dp, and a pipeline on pp
  with Megatron's cut (blocks split evenly, the embedding with the first stage, the head with the last; or
  ``blocks_per_stage``, one count per stage, as Megatron-LM's first/last-stage layer counts and torchtitan's split
  points cut a model whose blocks do not divide evenly), 1F1B (or interleaved with ``virtual_stages``),
  microbatches of ``microbatch_size`` rows per replica (default 1); ``zero=1`` is Megatron's distributed optimizer
  (ZeRO-1 over the data axes), the default ZeRO-0. A ``cp`` axis adds context parallelism inside the stages (4-D:
  attention's queries split by sequence on cp, ZeRO-1 over the data and cp axes).
An ``ep`` axis (expert parallelism, Megatron's and DeepSpeed's, carved out of data parallelism) composes with
``ddp``, ``fsdp`` and ``megatron`` ("+ep"): the batch split over it as over dp, every stack of experts
(``solver.expert_dims``) split along its expert dim on it, the other weights whole there; ZeRO shards over the data
and ep axes both (the experts over the data axes alone: ``zero.effective``).
What cannot be realised yet (ZeRO-2/3 with a pipeline, gradient accumulation inside a step without one -- a training
loop accumulates calls under ``ParallelModule.no_sync()`` instead --, an ep axis with a pipeline) is rejected with
an error that says so, never silently ignored.
"""

from __future__ import annotations

import fnmatch
import math

import torch

from autopar.errors import AutoparError, NotRealised, ShardingError
from autopar.mesh import Mesh
from autopar.plan import Plan
from autopar.solver import Pin, ZeroPin

STRATEGIES = ("ddp", "fsdp", "megatron", "megatron-3d", "explicit")

# (glob over parameter FQNs, placement on the tp axis) of each family's projections
_MEGATRON = {
    "gpt": [
        ("*.attn.c_attn.weight", "S(0)"), ("*.attn.c_attn.bias", "S(0)"), ("*.attn.c_proj.weight", "S(1)"),
        ("*.mlp.c_fc.weight", "S(0)"), ("*.mlp.c_fc.bias", "S(0)"), ("*.mlp.c_proj.weight", "S(1)"),
    ],
    "llama": [
        ("*.attention.w[qkv].weight", "S(0)"), ("*.attention.wo.weight", "S(1)"),
        ("*.feed_forward.w[13].weight", "S(0)"), ("*.feed_forward.w2.weight", "S(1)"),
    ],
    "mixtral": [
        ("*.attention.w[qkv].weight", "S(0)"), ("*.attention.wo.weight", "S(1)"),
        ("*.moe.w[13]", "S(1)"), ("*.moe.w2", "S(2)"),
    ],
    # Hugging Face: GPT-2's Conv1D keeps its weight (in, out), so a column split is S(1) and a row split S(0)
    "hf-gpt2": [
        ("*.attn.c_attn.weight", "S(1)"), ("*.attn.c_attn.bias", "S(0)"), ("*.attn.c_proj.weight", "S(0)"),
        ("*.mlp.c_fc.weight", "S(1)"), ("*.mlp.c_fc.bias", "S(0)"), ("*.mlp.c_proj.weight", "S(0)"),
    ],
    # Llama, Mistral, Qwen2/3, Gemma (Qwen2's q/k/v biases split with their columns)
    "hf-llama": [
        ("*.self_attn.[qkv]_proj.weight", "S(0)"), ("*.self_attn.[qkv]_proj.bias", "S(0)"), ("*.self_attn.o_proj.weight", "S(1)"),
        ("*.mlp.gate_proj.weight", "S(0)"), ("*.mlp.up_proj.weight", "S(0)"), ("*.mlp.down_proj.weight", "S(1)"),
    ],
}


def _family(tg) -> str | None:
    shape = {f: tuple(tg.gm.graph.find_nodes(op="placeholder", target=n)[0].meta["val"].shape) for n, f in tg.fqns.items()}
    for f, s in shape.items():
        if f.endswith("attn.c_attn.weight"):
            return "hf-gpt2" if s[1] > s[0] else "gpt"  # (in, 3 x in): a Conv1D; (3 x out, in): a Linear
    if any(f.endswith(".moe.w1") for f in shape):
        return "mixtral"
    if any(f.endswith("attention.wq.weight") for f in shape):
        return "llama"
    if any(f.endswith("self_attn.q_proj.weight") for f in shape) and any(f.endswith("mlp.gate_proj.weight") for f in shape):
        return "hf-llama"
    return None


def _layout(tg, family: str) -> list[tuple[str, str]]:
    """The family's (glob, placement) pairs that name something in this model (Llama has no q/k/v biases)."""
    return [(g, p) for g, p in _MEGATRON[family] if any(fnmatch.fnmatchcase(f, g) for f in tg.fqns.values())]


def _activations(ndim: int, data, cp, t: int | None, on_cp: str, on_tp: str = "S(1)") -> str:
    """An activation's Spec: the batch split on the data axes, ``on_cp`` on the cp axes, ``on_tp`` on tp axis ``t``."""
    return "".join(on_tp if a == t else on_cp if a in cp else ("S(0)" if a in data else "R") for a in range(ndim))


def _zero_pin(mesh: Mesh, stage: int, data, cp, ep=()) -> ZeroPin:
    """Every group's ZeRO stage; with cp, sharded over the data and cp axes both (torchtitan's dp_shard x cp); with
    ep, over the data and ep axes."""
    axes = sorted(set(data) | set(cp) | set(ep))
    return ZeroPin("*", stage, tuple(mesh.names[a] for a in axes) if (cp or ep) and stage else None)


def _with_experts(spec: str, ep, dim: int | None) -> str:
    """``spec`` (one placement per axis) with a stack of experts (expert dim ``dim``; None: not one) split on the
    ep axes."""
    if dim is None or not ep:
        return spec
    from autopar.spec import Spec

    placements = [str(p) for p in Spec.parse(spec).placements]
    return "".join(f"S({dim})" if a in ep else p for a, p in enumerate(placements))


def _megatron_pins(tg, family: str, t: int, data, ndim: int, sequence_parallel: bool, cp=(), ep=(), experts=None) -> list:
    """Megatron's layout on tp axis ``t``: the family's projections column- then row-parallel (whole on the other
    axes); attention on its tp rank's heads (dim 1 of (B, H, T, D)), pinned so that the solver does not swap it for
    a split of the queries on tp -- where attention is one fused op; each block's residual adds split by
    sequence (dim 1 of (B, T, C)) on tp with ``sequence_parallel``, else whole there. Activations keep the batch
    split on the data axes and, with context parallelism on the axes ``cp``, the sequence split there (attention's
    queries: dim 2); the stacks of ``experts`` (FQN -> expert dim) split on the ``ep`` axes too."""
    on_tp = lambda p: "".join(p if a == t else "R" for a in range(ndim))  # noqa: E731
    experts = experts or {}
    pins = []
    for glob, placement in _layout(tg, family):
        dims = {d for f, d in experts.items() if fnmatch.fnmatchcase(f, glob)}
        pins.append(Pin(glob, _with_experts(on_tp(placement), ep, min(dims) if dims else None)))
    sdpa = torch.ops.aten.scaled_dot_product_attention.default
    if any(n.op == "call_function" and n.target is sdpa for n in tg.gm.graph.nodes):
        pins.append(Pin("*:scaled_dot_product_attention*", _activations(ndim, data, cp, t, "S(2)")))
    # each block's residual adds: split by sequence on tp with sequence parallelism, else whole there, as Megatron
    # all-reduces a row-parallel output before its add (left free, the solver finds sequence parallelism by itself)
    on = "S(1)" if sequence_parallel else "R"
    pins += [Pin(f"{b.fqn}:add*", _activations(ndim, data, cp, t, "S(1)", on_tp=on)) for b in tg.blocks]
    return pins


def _reject_unrealised(strategy: str, mesh: Mesh, pp, schedule, virtual_stages, microbatches, recompute, zero, blocks_per_stage=None) -> None:
    pipe = mesh.pipe_axis()
    if pp not in (None, 1) and (pipe is None or mesh.sizes[pipe] != pp):
        raise ShardingError(f"{strategy}: pp={pp} needs a mesh with a pp axis of that size; mesh {mesh} has {'none' if pipe is None else mesh.sizes[pipe]}")
    if strategy == "megatron-3d" and pipe is None:
        raise ShardingError(f"megatron-3d needs a mesh with a pp axis larger than 1 (e.g. dp=2,pp=2,tp=2); mesh {mesh} has none. Use megatron for tp + dp")
    if pipe is None:
        for name, val in (("schedule", schedule), ("virtual_stages", virtual_stages), ("microbatches", microbatches),
                          ("blocks_per_stage", blocks_per_stage)):
            if val not in (None, 1):
                raise ShardingError(f"{strategy}: {name}={val!r} is a pipeline knob; the mesh {mesh} has no pp axis")
    elif zero not in (None, 0, 1):
        raise NotRealised(f"{strategy}: zero={zero} with pipeline parallelism is not realised (the microbatches accumulate whole "
                          "gradients, synced once a step: ZeRO-2 would hold what ZeRO-1 holds, ZeRO-3 would gather for every "
                          "microbatch); use zero=1 (Megatron's distributed optimizer) or zero=0")
    from autopar.cost import RECOMPUTE

    if recompute not in RECOMPUTE:
        raise AutoparError(f"{strategy}: recompute={recompute!r} is not one of {', '.join(RECOMPUTE)}")


def _megatron_3d(model, mesh: Mesh, example_inputs, pipe: int, data, tp_axes, batch, microbatch_size, microbatches, schedule,
                 virtual_stages, sequence_parallel, memory_budget, traces, recompute="none", blocks_per_stage=None, zero=None,
                 cp_axes=()) -> Plan:
    """Megatron-LM's 3-D parallelism: Megatron layouts on tp, data parallel on dp, and on pp the blocks split evenly
    (embedding with the first stage, head with the last), 1F1B by default (interleaved with ``virtual_stages``),
    microbatches of ``microbatch_size`` rows per replica (default 1, Megatron's default) or ``microbatches``;
    ``zero=1``: the distributed optimizer (``--use-distributed-optimizer``, ZeRO-1 over the data axes), else ZeRO-0.
    With ``cp_axes`` (Megatron's and torchtitan's 4-D: context parallelism inside the pipeline's stages): every
    attention's queries split by sequence on cp, and ZeRO-1 sharding over the data and cp axes both."""
    from autopar.pipeline import PipelinePin, plan_pipeline, trace_rows
    from autopar import _compat

    args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    replicas = math.prod(mesh.sizes[a] for a in data) if data else 1
    per_replica = (batch or 1) // replicas
    for knob, value in (("microbatch_size", microbatch_size), ("microbatches", microbatches), ("virtual_stages", virtual_stages)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise AutoparError(f"megatron-3d: {knob}={value!r}; give a whole number >= 1 (or leave it out)")
    if microbatches is None:
        size = microbatch_size or 1
        if per_replica % size:
            raise ShardingError(f"megatron-3d: microbatch_size={size} does not divide the per-replica batch of {per_replica} rows")
        microbatches = per_replica // size
    if schedule is None:
        schedule = "interleaved" if virtual_stages not in (None, 1) else "1f1b"
    pins: list = [_zero_pin(mesh, zero or 0, data, cp_axes)] if data or cp_axes else []
    knobs = [f"{schedule}", f"m={microbatches}"] + ([f"v={virtual_stages}"] if virtual_stages not in (None, 1) else [])
    if tp_axes:
        with _compat.no_local_tensor_mode():
            tg = trace_rows(model, args, (batch or 1) // microbatches, traces)
        family = _family(tg)
        if family is None:
            raise AutoparError("megatron-3d has no tensor-parallel layout for this model (no GPT-, Llama- or Mixtral-style projections, "
                               "nor Hugging Face's GPT-2 or Llama-style ones found)")
        pins += _megatron_pins(tg, family, tp_axes[0], data, mesh.ndim, sequence_parallel, cp_axes)
        if sequence_parallel:
            knobs.append("sp")
    elif cp_axes:  # context parallel: every attention's queries split by sequence on cp (keys, values whole)
        pins.append(Pin("*:scaled_dot_product_attention*", _activations(mesh.ndim, data, cp_axes, None, "S(2)")))
    if zero and (data or cp_axes):
        knobs.append(f"zero={zero}")
    if blocks_per_stage is not None:
        knobs.append("cuts=" + "/".join(map(str, blocks_per_stage)))
    pin = PipelinePin(schedule=schedule, microbatches=microbatches, virtual=virtual_stages if virtual_stages not in (None, 1) else None,
                      cuts=tuple(blocks_per_stage) if blocks_per_stage is not None else "equal")
    if recompute != "none":
        knobs.append(f"recompute={recompute}")
    plan = plan_pipeline(model, args, mesh, memory_budget, pins, pin, traces=traces, recompute=recompute)
    plan.label = f"megatron-3d({','.join(knobs)})"
    return plan


def handwritten(
    model,
    mesh: Mesh,
    example_inputs,
    strategy: str,
    *,
    microbatch_size: int | None = None,
    schedule: str | None = None,
    virtual_stages: int | None = None,
    sequence_parallel: bool | None = None,
    recompute: str = "none",
    zero: int | None = None,
    tp: int | None = None,
    pp: int | None = None,
    dp: int | None = None,
    microbatches: int | None = None,
    memory_budget: float | None = None,
    traced=None,
    traces: dict | None = None,
    blocks_per_stage: tuple[int, ...] | None = None,
    mixed_precision=None,
) -> Plan:
    """The Plan of a hand-written strategy (see the module docstring); raises for what is not realised yet.

    ``traced``: the model's TracedGraph when the caller has one already (tracing a large model takes seconds);
    ``traces``: with a pipeline, a cache of microbatch traces (rows -> TracedGraph) shared by several plans.
    ``mixed_precision`` (``autopar.MixedPrecision``): the strategy as it runs under that policy (``traced`` and
    ``traces`` are then the policy's traces)."""
    from autopar.api import _as_mesh, _check_budget
    from autopar.planner import make_plan
    from autopar import _compat
    from autopar.trace import trace

    mesh = _as_mesh(mesh)
    if mixed_precision is not None:  # the same strategy on the model as it computes, priced as it reduces
        from autopar.precision import as_computed, check, stamped

        check(model, mixed_precision)
        twin, args, priced = as_computed(model, example_inputs, mesh, mixed_precision)
        plan = handwritten(twin, priced, args, strategy, microbatch_size=microbatch_size, schedule=schedule,
                           virtual_stages=virtual_stages, sequence_parallel=sequence_parallel, recompute=recompute, zero=zero, tp=tp, pp=pp, dp=dp,
                           microbatches=microbatches, memory_budget=memory_budget, traced=traced, traces=traces,
                           blocks_per_stage=blocks_per_stage)
        return stamped(plan, mesh, mixed_precision)
    _check_budget(memory_budget)
    strategy = strategy.lower()
    if strategy not in STRATEGIES:
        raise AutoparError(f"unknown strategy {strategy!r}; known: {', '.join(STRATEGIES)}")
    _reject_unrealised(strategy, mesh, pp, schedule, virtual_stages, microbatches, recompute, zero, blocks_per_stage)
    pipe = mesh.pipe_axis()
    if zero is not None and zero not in (0, 1, 2, 3):
        raise AutoparError(f"zero={zero!r}: ZeRO stages are 0, 1, 2, 3")
    data = [a for a in range(mesh.ndim) if mesh.role(a) == "data" and mesh.sizes[a] > 1]
    tp_axes = [a for a in range(mesh.ndim) if mesh.names[a] == "tp" and mesh.sizes[a] > 1]
    cp_axes = [a for a in range(mesh.ndim) if mesh.names[a] == "cp" and mesh.sizes[a] > 1]
    ep_axes = [a for a in range(mesh.ndim) if mesh.role(a) == "expert" and mesh.sizes[a] > 1]
    other = [a for a in range(mesh.ndim) if mesh.sizes[a] > 1 and a not in data + tp_axes + cp_axes + ep_axes and a != pipe]
    if other:
        names = ", ".join(f"{mesh.names[a]}={mesh.sizes[a]}" for a in other)
        raise NotRealised(f"{strategy}: mesh axes {names} have no role in this strategy (it uses dp..., tp, cp, ep and pp axes)")
    if ep_axes and (pipe is not None or strategy == "explicit" or cp_axes):
        raise NotRealised(f"{strategy}: an ep axis composes with ddp, fsdp and megatron on a mesh without pp or cp; mesh {mesh}. "
                          "Plan it with autopar.plan, which composes ep with pipelines")
    if cp_axes and strategy not in ("ddp", "fsdp", "megatron-3d", "explicit"):
        raise NotRealised(f"{strategy}: a cp axis composes with ddp / fsdp on the data axes and Megatron on tp (torchtitan's "
                          f"FSDP + CP, FSDP + TP + CP), or with a pipeline (megatron-3d); mesh {mesh}")
    if strategy == "explicit":
        want = {"tp": tp or 1, "dp": dp or 1, "pp": pp or 1}
        have = {"tp": math.prod(mesh.sizes[a] for a in tp_axes), "dp": math.prod(mesh.sizes[a] for a in data),
                "pp": mesh.sizes[pipe] if pipe is not None else 1}
        if want != have:
            raise ShardingError(f"explicit tp={want['tp']} dp={want['dp']} pp={want['pp']} needs a mesh with those degrees; mesh {mesh} has "
                                f"tp={have['tp']} dp={have['dp']} pp={have['pp']}")
        strategy = "megatron-3d" if pipe is not None else "megatron" if want["tp"] > 1 else ("fsdp" if zero == 3 else "ddp")
    if sequence_parallel is None:  # as each runs by default: torchtitan's TP always splits the norms' sequence (its
        # SequenceParallel), Megatron-LM's only under --sequence-parallel
        sequence_parallel = strategy in ("ddp", "fsdp") and bool(tp_axes)
    batch = next((t.shape[0] for t in (example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)) if hasattr(t, "shape")), None)
    if strategy in ("ddp", "fsdp") and pipe is not None:
        raise NotRealised(f"{strategy} on a mesh with pp: use megatron-3d (pipeline + tp + dp), or a mesh without pp")
    if pipe is not None:
        return _megatron_3d(model, mesh, example_inputs, pipe, data, tp_axes, batch, microbatch_size, microbatches, schedule,
                            virtual_stages, sequence_parallel, memory_budget, traces, recompute, blocks_per_stage, zero, cp_axes)
    if microbatch_size is not None and batch is not None:
        local = batch // max(1, math.prod(mesh.sizes[a] for a in data + ep_axes))
        if microbatch_size != local:
            raise NotRealised(
                f"{strategy}: microbatch_size={microbatch_size} with a per-rank batch of {local} needs gradient accumulation "
                "over microbatches inside a step, which a plan without a pipeline does not realise; plan the global batch "
                "that gives one microbatch per rank and accumulate the calls in your loop under pmodel.no_sync()"
            )
    rep_all = "R" * mesh.ndim
    pins: list = []
    label = strategy
    if strategy in ("ddp", "fsdp") and not data and not cp_axes and not ep_axes:
        raise ShardingError(f"{strategy} needs a data axis (named dp...) larger than 1; mesh {mesh} has none")
    if strategy in ("ddp", "fsdp") and tp_axes:  # torchtitan's 2-D composition: Megatron on tp, DDP / FSDP on dp
        zero = zero if zero is not None else (3 if strategy == "fsdp" else 0)
        label, strategy = f"{strategy}+tp" + ("+cp" if cp_axes else ""), "megatron"
    if strategy in ("ddp", "fsdp"):
        stage = zero if zero is not None else (3 if strategy == "fsdp" else 0)
        pins = [_zero_pin(mesh, stage, data, cp_axes, ep_axes)]
        if cp_axes:
            label += "+cp"
    if ep_axes:
        label += "+ep"
    tg = traced
    if tg is None:
        with _compat.no_local_tensor_mode():
            tg = trace(model, example_inputs if isinstance(example_inputs, tuple) else (example_inputs,))
    from autopar.solver import expert_dims

    experts = {tg.fqns[n]: d for n, d in expert_dims(tg).items()} if ep_axes else {}
    if strategy in ("ddp", "fsdp"):
        pins += [Pin(f, _with_experts(rep_all, ep_axes, experts.get(f))) for n, f in tg.fqns.items() if tg.kinds.get(n) == "param"]
        if cp_axes:  # context parallel: every attention's queries split by sequence on cp (keys, values whole)
            pins.append(Pin("*:scaled_dot_product_attention*", _activations(mesh.ndim, data, cp_axes, None, "S(2)")))
    elif strategy == "megatron":
        if not tp_axes:
            raise ShardingError(f"megatron needs a tp axis larger than 1; mesh {mesh} has none")
        family = _family(tg)
        if family is None:
            raise AutoparError(
                "megatron has no tensor-parallel layout for this model (no GPT-, Llama- or Mixtral-style projections, "
                "nor Hugging Face's GPT-2 or Llama-style ones "
                "found); pin its weights yourself with autopar.plan(..., constraints=[autopar.Pin(fqn, spec)])"
            )
        pins += _megatron_pins(tg, family, tp_axes[0], sorted(data + ep_axes), mesh.ndim, sequence_parallel, cp_axes, ep_axes, experts)
        if data or cp_axes or ep_axes:
            pins.append(_zero_pin(mesh, zero if zero is not None else 0, data, cp_axes, ep_axes))
    plan = make_plan(tg, mesh, memory_budget, pins, recompute)
    knobs = []
    if sequence_parallel:
        knobs.append("sp")
    if recompute != "none":
        knobs.append(f"recompute={recompute}")
    if zero is not None and label == strategy:
        knobs.append(f"zero={zero}")
    plan.label = label + (f"({','.join(knobs)})" if knobs else "")
    return plan
