"""The ``autopar`` command.

- ``autopar`` (no arguments): the main job. Plans Llama-3-8B on one node of 8 x H100 and prints the plan; then
  trains a small GPT on 4 local gloo ranks (launched with torch's own launcher) and shows its loss equals
  single-device training.
- ``autopar plan MODEL --mesh dp=8,tp=8 --hardware h100-80gb [--batch B] [--seq S] [--memory-budget GiB]
  [--dtype bf16] [--mixed-precision bf16/fp32] [--json FILE] [--explain NAME]``: plan only (MODEL: a registry
  name or ``module:callable``). ``--cluster 192x8`` instead of ``--mesh``: search the mesh too (dp x pp x tp,
  microbatches, recomputation). ``--mixed-precision PARAM[/REDUCE]``: plan the model (then fp32 unless ``--dtype``
  says otherwise) as it trains under ``autopar.MixedPrecision(PARAM, REDUCE)``. ``--optimizer fused|foreach|for-loop``:
  how the AdamW that will train it steps (the preset's, torch's default on GPUs: foreach), which sets what its step
  allocates beside the state (``Hardware.optimizer_kernel``).
- ``autopar compare MODEL --mesh ... [--plans auto,megatron,fsdp] [--mixed-precision ...]``: autopar's plan next to
  hand-written ones.
- ``autopar demo [--nproc 4] [--steps 5]``: only the distributed half of the main job.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import math
import os
import socket
import subprocess
import sys
import time

import torch

from autopar.hardware import OPTIMIZER_KERNELS, get_hardware

DEFAULT_SEQ = 2048  # tokens per sequence unless --seq says otherwise (capped at the model's context)
OPTIMIZER_HELP = ("how the AdamW that trains the model steps, which sets what its step allocates beside the state: fused "
                  "(AdamW(fused=True): nothing), foreach (torch's default on GPUs: a copy of what a rank steps), for-loop "
                  "(foreach=False, torch's default on CPUs); default: the hardware preset's")
DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16}


MAX_DEVICES = 2**24  # a mesh or cluster larger than any machine: a typo (and a default batch too large to allocate)


def _count(text: str) -> bool:
    """Plain decimal digits (str.isdigit also takes superscripts such as "²", which int() refuses)."""
    return text.isascii() and text.isdigit()


def _parse_mesh(text: str) -> dict[str, int]:
    axes = {}
    for part in text.split(","):
        name, _, size = part.partition("=")
        if not _count(size.strip()):
            raise SystemExit(f"autopar: --mesh wants name=size pairs like dp=8,tp=8; got {text!r}")
        if name.strip() in axes:
            raise SystemExit(f"autopar: --mesh names axis {name.strip()!r} twice ({text!r}); give each axis once")
        axes[name.strip()] = int(size)
    if math.prod(axes.values()) > MAX_DEVICES:
        raise SystemExit(f"autopar: --mesh {text!r} has {math.prod(axes.values()):,} devices, more than autopar plans for "
                         f"({MAX_DEVICES:,}); check the sizes")
    return axes


def _load_model(spec: str, dtype, context: int | None = None):
    import models

    if spec in models.REGISTRY:
        return models.build(spec, device="meta", dtype=dtype, context=context)
    if ":" in spec:
        mod, _, fn = spec.partition(":")
        try:
            make = getattr(importlib.import_module(mod), fn)
        except (ImportError, AttributeError) as e:
            raise SystemExit(f"autopar: cannot load the model {spec!r} ({type(e).__name__}: {e}); give module:callable, the "
                             "module importable from here (PYTHONPATH) and the callable returning (model, inputs(batch, seq))") from None
        if not callable(make):
            raise SystemExit(f"autopar: {spec} is a {type(make).__name__}, not a callable returning (model, inputs(batch, seq))")
        try:
            inspect.signature(make).bind()
        except TypeError as e:
            raise SystemExit(f"autopar: {spec} must be callable without arguments ({e}); wrap it: a function that builds "
                             "and returns (model, inputs(batch, seq))") from None
        except ValueError:  # (a builtin without a signature: called as it is)
            pass
        out = make()
        if isinstance(out, tuple) and len(out) == 2 and callable(out[1]):
            return out
        raise SystemExit(f"autopar: {spec} must return (model, inputs(batch, seq)); it returned {type(out).__name__}")
    raise SystemExit(f"autopar: unknown model {spec!r}; known: {', '.join(models.REGISTRY)} (or module:callable)")


def _policy(args):
    """``--mixed-precision PARAM[/REDUCE]`` as an ``autopar.MixedPrecision`` (None without it)."""
    import autopar

    text = getattr(args, "mixed_precision", None)
    if not text:
        return None
    parts = text.split("/")
    if len(parts) > 2:
        raise SystemExit(f"autopar: --mixed-precision wants PARAM or PARAM/REDUCE, like bf16/fp32; got {text!r}")
    return autopar.MixedPrecision(*parts)


def _plan_verbose(model, mesh, inputs, budget):
    """Plan with a line per phase (a big model takes seconds to trace and solve)."""
    from autopar.planner import make_plan
    from autopar.trace import trace

    t = time.perf_counter()
    print("  tracing ...", end="", flush=True)
    tg = trace(model, inputs)
    print(f" {len(tg.gm.graph.nodes)} nodes, {sum(b.tied_to is not None for b in tg.blocks)} tied blocks ({time.perf_counter() - t:.1f} s); solving ...",
          end="", flush=True)
    t = time.perf_counter()
    plan = make_plan(tg, mesh, budget)
    print(f" {int(plan.timings.get('ilp variables', 0))} ILP variables ({time.perf_counter() - t:.1f} s)", flush=True)
    return plan, tg


def _handwritten_for(mesh) -> list:
    """The hand-written strategies that apply to this mesh's axes."""
    data = [a for a in mesh.batch_axes() if mesh.sizes[a] > 1]  # with ep: "+ep"
    tp = [a for a in range(mesh.ndim) if mesh.names[a] == "tp" and mesh.sizes[a] > 1]
    if mesh.pipe_axis() is not None:  # Megatron-LM's 3-D: 1F1B, and interleaved with 2 stages per rank
        out = ["megatron-3d", ("megatron-3d", {"virtual_stages": 2})]
        return out + ([("megatron-3d", {"sequence_parallel": True})] if tp else [])
    if tp and data:  # Megatron-LM's distributed optimizer is ZeRO-1; fsdp here is torchtitan's FSDP + TP
        return ["megatron", ("megatron", {"sequence_parallel": True, "zero": 1}), "fsdp"]
    if tp:
        return ["megatron", ("megatron", {"sequence_parallel": True})]
    return ["ddp", "fsdp"] if data else []


def _parse_cluster(text: str) -> tuple[int, int]:
    nodes, _, gpus = text.lower().partition("x")
    if not (_count(nodes.strip()) and _count(gpus.strip())):
        raise SystemExit(f"autopar: --cluster wants NODESxGPUS_PER_NODE like 192x8; got {text!r}")
    if int(nodes) * int(gpus) > MAX_DEVICES:
        raise SystemExit(f"autopar: --cluster {text!r} has {int(nodes) * int(gpus):,} devices, more than autopar plans for "
                         f"({MAX_DEVICES:,}); check the sizes")
    return int(nodes), int(gpus)


def _json_target(path: str) -> None:
    """Refuse a --json path before planning (a bad one would fail only after it): a folder, a folder that is not
    there or cannot be written, or a file that is not an autopar plan (replacing a plan is what --json is for;
    anything else the user had there is not autopar's to overwrite)."""
    import tempfile

    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise SystemExit(f"autopar: --json {path}: the folder {folder} does not exist")
    if os.path.isdir(path):
        raise SystemExit(f"autopar: --json {path} is a folder; give a file name in it, e.g. {os.path.join(path, 'plan.json')}")
    if os.path.exists(path):
        try:
            with open(path, encoding="utf-8") as f:
                head = f.read(4096)
        except (OSError, UnicodeDecodeError):
            head = None
        if head is None or (head.strip() and '"format": "autopar.plan"' not in head):
            raise SystemExit(f"autopar: --json {path} exists and is not an autopar plan; nothing was planned. Give "
                             "another file name, or move that file away")
    try:  # can a file be made beside it (the plan is written there first, then renamed over the path)?
        fd, probe = tempfile.mkstemp(dir=os.path.dirname(os.path.realpath(path)), prefix=".autopar-", suffix=".json")
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        raise SystemExit(f"autopar: --json {path}: cannot write in {folder} ({e.strerror}); give a path you can write") from None


def _write_json(path: str, text: str) -> None:
    """Write the plan beside ``path`` and rename it over it: a run stopped midway leaves the old file whole. Through
    a symbolic link to its target; with the old file's permissions, or a new file's (the umask's)."""
    target = os.path.realpath(path)
    tmp = f"{target}.autopar-{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # (a new file's permissions: the umask's)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        if os.path.exists(target):
            os.chmod(tmp, os.stat(target).st_mode & 0o777)
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    print(f"plan written to {path}")


def cmd_plan_cluster(args) -> int:
    import autopar
    from autopar.cluster import search_table

    t0 = time.perf_counter()
    model, inputs = _load_model(args.model, DTYPES[args.dtype], getattr(args, "context", None))
    nodes, gpus = _parse_cluster(args.cluster)
    cluster = autopar.Cluster(nodes, gpus, args.hardware)
    batch = inputs(args.batch, args.seq)
    print(f"planning {args.model} on {cluster} ({cluster.devices} device{'s' if cluster.devices != 1 else ''}; {_shape(args, batch)}, {_dtypes(args)}): "
          "searching dp x pp x tp and dp x cp x tp (a mixture of experts: dp x ep too), microbatches, schedule, recomputation ...", flush=True)
    budget = args.memory_budget * 2**30 if args.memory_budget is not None else None
    plan = autopar.plan(model, cluster, batch, memory_budget=budget, mixed_precision=_policy(args))
    print(plan.table())
    print("\nscreened (best first):")
    print(search_table(plan))
    if args.json:
        _write_json(args.json, plan.to_json())
    print(f"planned in {time.perf_counter() - t0:.1f} s")
    return 0


def _shape(args, batch) -> str:
    """The global batch as traced: a registry model's inputs stop at its context, so --seq may ask for more."""
    first = next((t for t in (batch if isinstance(batch, tuple) else (batch,)) if isinstance(t, torch.Tensor)), None)
    if first is None or first.ndim < 2:
        return f"global batch {args.batch}"
    if first.ndim == 2 and first.is_floating_point():  # rows of features (an MLP's), no sequence: --seq is not read
        return f"global batch {first.shape[0]} x {first.shape[1]} features"
    capped = f" (--seq {args.seq}, capped at the model's context)" if args.seq and first.shape[1] != args.seq else ""
    return f"global batch {first.shape[0]} x seq {first.shape[1]}{capped}"


def cmd_plan(args) -> int:
    import autopar

    if getattr(args, "cluster", None):
        return cmd_plan_cluster(args)
    from autopar.precision import as_computed, check, stamped

    dtype, mp = DTYPES[args.dtype], _policy(args)
    t0 = time.perf_counter()
    model, inputs = _load_model(args.model, dtype, getattr(args, "context", None))
    mesh = autopar.Mesh(_parse_mesh(args.mesh), hardware=args.hardware)
    batch = inputs(args.batch, args.seq)
    print(f"planning {args.model} on {mesh} ({_shape(args, batch)}, {_dtypes(args)})", flush=True)
    budget = args.memory_budget * 2**30 if args.memory_budget is not None else None
    traces: dict = {}
    check(model, mp)
    twin, cast, priced = as_computed(model, batch, mesh, mp)  # the model as it computes under the policy
    if mesh.pipe_axis() is not None:
        from autopar.pipeline import plan_pipeline

        print("  tracing one microbatch per candidate count, solving each stage's plan, cutting stages ...", flush=True)
        plan, tg = plan_pipeline(twin, cast, priced, budget, [], traces=traces), None
    else:
        plan, tg = _plan_verbose(twin, priced, cast, budget)
    plan = stamped(plan, mesh, mp)
    print(plan.table())
    if args.json:  # (before explain: a name it does not know loses no plan)
        _write_json(args.json, plan.to_json())
    if args.explain:
        print()
        print(plan.explain(args.explain))
    others = _handwritten_for(mesh) if not getattr(args, "no_compare", False) else []
    if others:
        print("\ncompared with hand-written strategies on the same mesh (predicted):")
        print(autopar.compare(model, mesh, batch, plans=[plan] + others, memory_budget=budget, measure=False, traced=tg, traces=traces,
                              mixed_precision=mp).table())
    print(f"planned in {time.perf_counter() - t0:.1f} s")
    return 0


def cmd_compare(args) -> int:
    import autopar

    model, inputs = _load_model(args.model, DTYPES[args.dtype], getattr(args, "context", None))
    mesh = autopar.Mesh(_parse_mesh(args.mesh), hardware=args.hardware)
    plans = [p.strip() for p in args.plans.split(",")] if args.plans else ["auto"] + [p for p in _handwritten_for(mesh)]
    budget = args.memory_budget * 2**30 if args.memory_budget is not None else None
    t0 = time.perf_counter()
    batch = inputs(args.batch, args.seq)
    print(f"comparing plans for {args.model} on {mesh} ({_shape(args, batch)}, {_dtypes(args)}) ...", flush=True)
    print(autopar.compare(model, mesh, batch, plans=plans, memory_budget=budget,
                          mixed_precision=_policy(args)).table())
    print(f"compared in {time.perf_counter() - t0:.1f} s")
    return 0


def _dtypes(args) -> str:
    """The model's dtype, and the policy it computes under if one is given."""
    mp = _policy(args)
    return args.dtype if mp is None else f"{args.dtype} parameters, {mp}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cmd_demo(args) -> int:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.nproc}", "--master-addr=127.0.0.1",
        f"--master-port={_free_port()}", "-m", "autopar.demo", f"--steps={args.steps}",
    ]
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    print(f"$ torchrun --nproc-per-node {args.nproc} -m autopar.demo   (gloo, 127.0.0.1)", flush=True)
    return subprocess.call(cmd, env=env)


def cmd_main(_args) -> int:
    print("== 1. Plan Llama-3-8B on one node of 8 x H100 (dp=4 x tp=2), global batch 4 x 4096 tokens, bf16 ==", flush=True)
    rc = cmd_plan(argparse.Namespace(model="llama3-8b", mesh="dp=4,tp=2", hardware="h100-80gb", batch=4, seq=4096,
                                     dtype="bf16", memory_budget=None, json=None, explain="layers.0.attention.wq"))
    if rc:
        return rc
    print("\n== 2. Train a small GPT on 4 local gloo ranks, next to single-device training ==", flush=True)
    return cmd_demo(argparse.Namespace(nproc=4, steps=5))


class Refused(SystemExit):
    """Bad command-line input, refused before anything ran: the message is printed to stderr, the exit status is 2,
    as for argparse's own refusals and autopar's errors (``SystemExit(message)`` alone exits 1)."""

    def __init__(self, message: str):
        super().__init__(2)
        self.message = message

    def __str__(self) -> str:
        return self.message


def main(argv: list[str] | None = None) -> int:
    """The command line: 0 done, 2 refused (bad input: the message says what and how to fix it)."""
    try:
        return _main(argv)
    except SystemExit as e:
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
            raise Refused(e.code) from None
        raise


def _main(argv: list[str] | None) -> int:
    from autopar.demo import DEMO_BATCH
    from autopar.hardware import PRESETS

    ap = argparse.ArgumentParser(prog="autopar", description="a compiler for distributed training. With no command: the main "
                                 "job (plan Llama-3-8B on one node of 8 x H100, then train a small GPT on 4 local gloo "
                                 "ranks beside single-device training)")
    model_help = "a registry name (gpt-tiny, gpt2-small, llama3-8b, mixtral-8x7b, mlp, ...) or module:callable returning (model, inputs(batch, seq))"
    hw_help = f"the devices' preset: {', '.join(sorted(PRESETS))} (default h100-80gb)"
    sub = ap.add_subparsers(dest="cmd")
    p = sub.add_parser("plan", help="plan a model on a mesh (no devices needed)")
    p.add_argument("model", help=model_help)
    p.add_argument("--mesh", default=None, help="axes outermost first, e.g. dp=8,tp=8")
    p.add_argument("--cluster", default=None, help="NODESxGPUS, e.g. 192x8: search the mesh too (instead of --mesh)")
    p.add_argument("--hardware", default="h100-80gb", help=hw_help)
    p.add_argument("--batch", type=int, default=None, help="global batch (default: one sequence per data-parallel (or expert-parallel) rank; with pp, 8 x pp per rank)")
    p.add_argument("--seq", type=int, default=None, help=f"tokens per sequence (default {DEFAULT_SEQ}, or the model's context if shorter; longer than a known model's context, it extends it)")
    p.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="the model's parameters (default bf16; fp32 with --mixed-precision)")
    p.add_argument("--mixed-precision", default=None, metavar="PARAM[/REDUCE]",
                   help="train under autopar.MixedPrecision: compute in PARAM, reduce gradients in REDUCE (default PARAM), e.g. bf16/fp32")
    p.add_argument("--memory-budget", type=float, default=None, help="GiB per device (default: the device's memory)")
    p.add_argument("--optimizer", default=None, choices=OPTIMIZER_KERNELS, help=OPTIMIZER_HELP)
    p.add_argument("--json", default=None, help="write the plan as JSON to this file (it replaces a plan there, no other file)")
    p.add_argument("--explain", default=None, help="explain the choice for this parameter, module or node")
    c = sub.add_parser("compare", help="autopar's plan next to hand-written strategies (predicted; measured under torchrun)")
    c.add_argument("model", help=model_help)
    c.add_argument("--mesh", required=True, help="axes outermost first, e.g. dp=8,tp=8")
    c.add_argument("--hardware", default="h100-80gb", help=hw_help)
    c.add_argument("--batch", type=int, default=None, help="global batch (default: one sequence per data-parallel rank)")
    c.add_argument("--seq", type=int, default=None, help=f"tokens per sequence (default {DEFAULT_SEQ}, or the model's context if shorter)")
    c.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="the model's parameters (default bf16; fp32 with --mixed-precision)")
    c.add_argument("--mixed-precision", default=None, metavar="PARAM[/REDUCE]",
                   help="train under autopar.MixedPrecision: compute in PARAM, reduce gradients in REDUCE (default PARAM), e.g. bf16/fp32")
    c.add_argument("--memory-budget", type=float, default=None, help="GiB per device (default: the device's memory)")
    c.add_argument("--optimizer", default=None, choices=OPTIMIZER_KERNELS, help=OPTIMIZER_HELP)
    c.add_argument("--plans", default=None, help="comma-separated: auto, ddp, fsdp, megatron, ..., torch:fsdp, torch:megatron "
                   "(torch's own API: measured only, under torchrun) (default: those that apply)")
    d = sub.add_parser("demo", help="train a small GPT on local gloo ranks next to single-device training")
    d.add_argument("--nproc", type=int, default=4, help=f"local gloo processes, a divisor of the demo's global batch of {DEMO_BATCH} (default 4)")
    d.add_argument("--steps", type=int, default=5, help="AdamW steps (default 5)")
    args = ap.parse_args(argv)
    from autopar.errors import AutoparError

    if args.cmd in ("plan", "compare") and args.dtype is None:  # the master copy a policy steps is fp32
        args.dtype = "fp32" if args.mixed_precision else "bf16"
    if args.cmd in ("plan", "compare") and args.optimizer:  # the preset, as the user's optimizer steps on it
        try:
            args.hardware = dataclasses.replace(get_hardware(args.hardware), optimizer_kernel=args.optimizer)
        except AutoparError as e:
            raise SystemExit(f"autopar: {e}")
    if getattr(args, "memory_budget", None) is not None and not 0 < args.memory_budget < math.inf:
        raise SystemExit(f"autopar: --memory-budget wants a positive number of GiB per device; got {args.memory_budget}")
    if getattr(args, "json", None):  # before the planning: a path it cannot write would fail only after it
        _json_target(args.json)
    if getattr(args, "cluster", None) and getattr(args, "explain", None):
        raise SystemExit("autopar plan: --explain reads a plan on one mesh (--mesh); with --cluster, plan the chosen mesh with --mesh to explain it")
    if args.cmd == "demo" and args.nproc < 1:
        raise SystemExit(f"autopar demo: --nproc wants a positive number of processes; got {args.nproc}")
    if args.cmd == "demo" and DEMO_BATCH % args.nproc:
        raise SystemExit(f"autopar demo: --nproc {args.nproc} does not divide the demo's global batch of {DEMO_BATCH}: give "
                         f"one of {', '.join(str(n) for n in range(1, DEMO_BATCH + 1) if DEMO_BATCH % n == 0)}")
    if args.cmd == "demo" and args.steps < 1:
        raise SystemExit(f"autopar demo: --steps wants a positive number of steps; got {args.steps}")
    for flag in ("batch", "seq"):  # a zero-row or zero-token example would fail deep in tracing, or plan nothing
        value = getattr(args, flag, None)
        if value is not None and value < 1:
            raise SystemExit(f"autopar: --{flag} wants a positive number of {'sequences (the global batch)' if flag == 'batch' else 'tokens per sequence'}; got {value}")

    if args.cmd == "plan" and (args.mesh is None) == (args.cluster is None):
        raise SystemExit("autopar plan: give --mesh (plan on that mesh) or --cluster (search the mesh too), one of them")
    if args.cmd == "plan" and args.cluster and args.batch is None:
        args.batch = math.prod(_parse_cluster(args.cluster))  # one sequence per device
    # a --seq longer than a registry model's context extends it (long-context planning); the default is capped
    args.context = getattr(args, "seq", None)
    if args.cmd in ("plan", "compare") and args.seq is None:
        args.seq = DEFAULT_SEQ
    try:
        if getattr(args, "batch", 0) is None:  # one sequence per data-parallel rank by default; 8 per pipeline stage with pp
            axes = _parse_mesh(args.mesh)
            pp = axes.get("pp", 1)  # a pipeline needs microbatches to fill its stages
            from autopar.mesh import Mesh

            mesh = Mesh(axes)  # a bad axis size is a clear MeshError (below), not a traceback
            data = math.prod(mesh.sizes[a] for a in mesh.batch_axes())
            args.batch = max(1, data) * (8 * pp if pp > 1 else 1)
        if args.cmd == "plan":
            return cmd_plan(args)
        if args.cmd == "compare":
            return cmd_compare(args)
        if args.cmd == "demo":
            return cmd_demo(args)
        return cmd_main(args)
    except AutoparError as e:
        print(f"autopar: {type(e).__name__}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
