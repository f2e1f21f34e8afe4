"""Measure one GPU against its hardware preset: the cost model's rates, the AdamW step, and whole training steps.

Run: ``python benchmarks/calibrate_gpu.py --measure --json FILE`` on a machine with a CUDA device (about 2 min on an
H200; torch, ``models/`` and autopar, which ran there under torch 2.11; ``--runtime-check``'s planning needs
HiGHS, carried as a wheel where nothing can be installed), then ``python benchmarks/calibrate_gpu.py
--json FILE [--hardware h200]`` anywhere to print the preset's prediction beside each measurement. Without
``--json`` the second form reads the measurement stored in ``benchmarks/data/`` for the preset (one H200, torch
2.11 + CUDA 13, 2026-12-04).

What is measured (CUDA events; each figure the median of several calls after warm-up ones):

- the elementwise rate: ``x * 2.0`` on 1 GiB (bytes read and written per second; the preset's
  ``hbm_bandwidth * memory_efficiency``);
- matmul FLOP/s: bf16 ``(8192, 8192) @ (8192, d)`` for d from 128 to 8192, the preset's curve
  ``matmul_efficiency * d / (d + matmul_half_dim)`` in its smallest dimension d, and fp32 (no TF32: torch's default);
- fused causal attention (SDPA, bf16, head dim 128): forward and backward, as FLOP/s of the work its kernel runs
  (the tiles on and below the diagonal) against ``attention_efficiency``;
- torch's AdamW step in each of its three implementations (``Hardware.optimizer_kernel``) on fp32 parameters of
  unequal sizes: seconds per element, as bytes at the elementwise rate (the preset's ``optimizer_step_bytes``, per
  kernel), and the bytes it allocates beside the state and gradients (``cost.step_temporaries``);
- whole training steps on one device: a GPT-2-medium-shaped model in fp32 and a Llama-3-shaped one under the
  mixed precision autopar runs (fp32 parameters cast to bf16 where they are read, ``MixedPrecision(bf16, fp32)``:
  ``torch.func.functional_call`` on the cast parameters), forward + backward and the optimizer step timed apart,
  and the peak of allocated memory over the steps; beside ``autopar.plan``'s prediction for the same model, batch
  and optimizer on a one-device mesh of the preset.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from autopar.hardware import ADAMW_KWARGS  # noqa: E402

STORED = {"h200": os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "h200.json")}
ELEMENTWISE_BYTES = 1 << 30
MATMUL_MK = 8192
MATMUL_DIMS = (128, 256, 512, 1024, 2048, 4096, 8192)
ATTENTION = ((4, 16, 4096, 128), (1, 32, 8192, 128))  # (batch, heads, sequence, head dim)
ADAMW_SIZES = [64 << 20, 16 << 20, 48 << 20, 4 << 20] * 6  # fp32 elements per parameter: 0.79 G in all, unequal
GPT_RUN = {"model": "gpt", "config": dict(n_layer=24, n_head=16, n_embd=1024, block_size=1024), "batch": 8,
           "seq": 1024, "precision": "fp32"}
LLAMA_RUN = {"model": "llama", "config": dict(vocab_size=128256, max_seq_len=4096, n_layer=8, n_head=16,
                                                n_kv_head=8, dim=2048, ffn_dim=8192), "batch": 2, "seq": 4096,
             "precision": "bf16/fp32"}
RUNS = [dict(GPT_RUN, kernel="foreach"), dict(GPT_RUN, kernel="fused"), dict(LLAMA_RUN, kernel="foreach"),
        dict(LLAMA_RUN, kernel="fused")]


# --- measuring (CUDA, plain torch) ---------------------------------------------------------------------------
def _timed(fn, calls: int = 10, warmup: int = 3) -> float:
    """Median seconds of ``fn()`` over ``calls`` calls after ``warmup``, each between two CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(calls):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def _elementwise(dev) -> dict:
    out = {}
    for dt in (torch.float32, torch.bfloat16):
        x = torch.ones(ELEMENTWISE_BYTES // torch.empty((), dtype=dt).element_size(), dtype=dt, device=dev)
        s = _timed(lambda: x * 2.0)
        out[str(dt).replace("torch.", "")] = {"bytes": 2 * x.numel() * x.element_size(), "seconds": s}
    return out


def _matmuls(dev) -> list:
    rows = []
    for dt, dims in ((torch.bfloat16, MATMUL_DIMS), (torch.float32, (MATMUL_MK,))):
        for d in dims:
            a = torch.randn(MATMUL_MK, MATMUL_MK, dtype=dt, device=dev)
            b = torch.randn(MATMUL_MK, d, dtype=dt, device=dev)
            s = _timed(lambda: a @ b, calls=10 if d >= 1024 else 30)
            rows.append({"dtype": str(dt).replace("torch.", ""), "m": MATMUL_MK, "k": MATMUL_MK, "n": d, "seconds": s})
    return rows


def _attention(dev) -> list:
    import torch.nn.functional as F
    rows = []
    for shape in ATTENTION:
        q, k, v = (torch.randn(*shape, dtype=torch.bfloat16, device=dev, requires_grad=True) for _ in range(3))
        fwd = _timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
        g = torch.randn(*shape, dtype=torch.bfloat16, device=dev)

        def both():
            F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(g)
        rows.append({"shape": list(shape), "forward": fwd, "forward_backward": _timed(both)})
    return rows


def _adamw(dev) -> list:
    rows = []
    for kernel, kwargs in ADAMW_KWARGS.items():
        params = [torch.nn.Parameter(torch.randn(n, device=dev)) for n in ADAMW_SIZES]
        for p in params:
            p.grad = torch.randn_like(p)
        opt = torch.optim.AdamW(params, lr=1e-4, **kwargs)
        opt.step()  # the moments' first allocation
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        s = _timed(opt.step, calls=5, warmup=1)
        rows.append({"kernel": kernel, "elements": sum(ADAMW_SIZES), "seconds": s,
                     "temporaries": torch.cuda.max_memory_allocated() - base})
        del opt, params
        torch.cuda.empty_cache()
    return rows


def build(run: dict, device):
    """The run's model (on ``device``; "meta" for planning) and its (tokens, targets)."""
    if run["model"] == "gpt":
        from models.gpt import GPT, GPTConfig
        cfg = GPTConfig(**run["config"])
        vocab = cfg.vocab_size
        with torch.device(device):
            model = GPT(cfg)
    else:
        from models.llama import Llama, LlamaConfig
        cfg = LlamaConfig(**run["config"])
        vocab = cfg.vocab_size
        with torch.device(device):
            model = Llama(cfg)
    gen = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, vocab, (run["batch"], run["seq"]), generator=gen).to(device) for _ in range(2))
    return model, (x, y)


def _train(run: dict, dev, steps: int = 6, mesh=None) -> dict:
    """Train ``run``'s model ``steps`` steps after 2 (eagerly, or with ``mesh`` parallelized by autopar's runtime):
    median seconds of forward + backward and of the optimizer step, the peak of allocated memory over the timed
    steps, and what is allocated once the loss is computed (the state and what forward keeps for backward)."""
    torch.manual_seed(0)
    model, (x, y) = build(run, dev)
    mixed = run["precision"] == "bf16/fp32"
    if mesh is not None:
        import autopar
        mp = autopar.MixedPrecision(torch.bfloat16, torch.float32) if mixed else None
        model = autopar.parallelize(model, mesh, example_inputs=(x, y), mixed_precision=mp)
        x, y = model.local_inputs(x, y)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, **ADAMW_KWARGS[run["kernel"]])
    names = dict(model.named_parameters())
    kept = []

    def fwd_bwd():
        if mixed and mesh is None:  # MixedPrecision(bf16, fp32): each parameter cast where read, grads in fp32
            loss = torch.func.functional_call(model, {n: p.to(torch.bfloat16) for n, p in names.items()}, (x, y))
        else:
            loss = model(x, y)
        kept.append(torch.cuda.memory_allocated())
        loss.backward()
        return loss

    fb, st = [], []
    for i in range(steps + 2):
        if i == 2:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        e = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        e[0].record()
        fwd_bwd()
        e[1].record()
        opt.step()
        opt.zero_grad(set_to_none=True)
        e[2].record()
        e[2].synchronize()
        if i >= 2:
            fb.append(e[0].elapsed_time(e[1]) / 1e3)
            st.append(e[1].elapsed_time(e[2]) / 1e3)
    out = dict(run, forward_backward=statistics.median(fb), optimizer=statistics.median(st),
               peak=torch.cuda.max_memory_allocated(), after_forward=kept[-1],
               params=sum(p.numel() for p in model.parameters()), runtime="autopar" if mesh is not None else "eager")
    return out


def _trains(dev) -> list:
    rows = []
    for run in RUNS:
        rows.append(_train(run, dev))
        torch.cuda.empty_cache()
    return rows


def _overhead(dev, ops: int = 200) -> dict:
    """Seconds per tiny op (a (4, 16) tensor: no roofline time) forward and backward, launched from Python under
    autograd as eager torch runs them: the preset's ``op_overhead``."""
    x0 = torch.randn(4, 16, device=dev, requires_grad=True)

    def chain():
        x = x0
        for _ in range(ops):
            x = x * 1.0001
        x.sum().backward()
    return {"ops": ops, "seconds": _timed(chain, calls=10, warmup=3)}


def _parity(mesh, dev):
    import copy
    import autopar
    from models.gpt import GPT, GPTConfig
    cfg = GPTConfig(n_layer=4, n_head=8, n_embd=512, block_size=256)
    torch.manual_seed(0)
    ref = GPT(cfg).to(dev)
    gen = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, cfg.vocab_size, (8, 256), generator=gen).to(dev) for _ in range(2))
    pm = autopar.parallelize(copy.deepcopy(ref), mesh, example_inputs=(x, y))
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (pm, ref)]
    steps = [lambda: pm(*pm.local_inputs(x, y)), lambda: ref(x, y)]

    def train(i):
        loss = steps[i]()
        loss.backward()
        opts[i].step()
        opts[i].zero_grad(set_to_none=True)
        return float(loss.detach())
    losses = [[train(i) for i in (0, 1)] for _ in range(3)]
    full = pm.full_state_dict()
    diff = max(float((full[k].to(dev) - v).abs().max()) for k, v in ref.state_dict().items() if k in full)
    secs = [_timed(lambda: train(i), calls=10, warmup=3) if dev.type == "cuda" else 0.0 for i in (0, 1)]
    return losses, diff, secs


def runtime_check() -> dict:
    """autopar's own runtime on this machine's device: a small GPT parallelized on a one-rank mesh (NCCL on a GPU,
    gloo otherwise), three AdamW steps beside the same model trained eagerly (losses and the largest parameter
    difference), then each one's seconds per step (median of 10 after 3)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    import autopar
    from autopar.hardware import get_hardware
    cuda = torch.cuda.is_available()
    for k, v in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29531"), ("RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(k, v)
    if cuda:
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if cuda else "gloo")
    dev = torch.device("cuda" if cuda else "cpu")
    try:
        mesh = autopar.Mesh.from_device_mesh(init_device_mesh(dev.type, (1,), mesh_dim_names=("dp",)),
                                             "h200" if cuda else "cpu-gloo")
        losses, diff, secs = _parity(mesh, dev)
        rows = []
        if cuda:  # the whole-step runs of ``RUNS`` (torch's default AdamW) again, under autopar's runtime
            for run in RUNS:
                if run["kernel"] == "foreach":
                    hw = dataclasses.replace(get_hardware("h200"), optimizer_kernel=run["kernel"])
                    rows.append(_train(run, dev, mesh=autopar.Mesh.from_device_mesh(mesh.to_device_mesh(), hw)))
                    torch.cuda.empty_cache()
        return {"losses": losses, "max_param_diff": diff, "autopar_step": secs[0], "eager_step": secs[1], "train": rows}
    finally:
        dist.destroy_process_group()


def _runtime_subprocess(dev) -> dict:
    """``runtime_check`` in a process of its own (a process group of its own; a hang costs at most 180 s)."""
    import subprocess
    r = subprocess.run([sys.executable, os.path.abspath(__file__), "--runtime-check"], capture_output=True, text=True,
                       timeout=180)
    if r.returncode:
        raise RuntimeError(r.stderr[-3000:])
    return json.loads(r.stdout.strip().splitlines()[-1])


def _read(path: str) -> dict:
    """A measurement file this script wrote, or a clear exit: not JSON (a pickle, a truncated write), or JSON of
    something else."""
    try:
        with open(path, encoding="utf-8") as f:
            m = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        sys.exit(f"calibrate_gpu.py: {path} is not a measurement this script wrote ({type(e).__name__}: {e})")
    if not isinstance(m, dict) or not {"device", "torch", "cuda", "date"} <= set(m):
        sys.exit(f"calibrate_gpu.py: {path} is JSON but not a measurement (no device, torch, cuda and date); give the file "
                 "--measure --json wrote")
    return m


def _write(path: str, result: dict) -> None:
    """Write beside ``path`` and rename over it: a run stopped while writing leaves the last whole file."""
    tmp = f"{path}.partial"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    os.replace(tmp, path)


def measure(path: str, sections: "list[str] | None" = None) -> dict:
    """Measure ``sections`` (all by default) and write them to ``path``; measuring some of them into an existing
    file replaces those there and keeps the rest."""
    dev = torch.device("cuda", 0)
    torch.backends.cuda.matmul.allow_tf32 = False  # torch's default: fp32 matmuls at the fp32 peak
    result = {}
    if sections and os.path.exists(path):
        result = _read(path)
    result.update({"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": torch.version.cuda,
                   "date": time.strftime("%Y-%m-%d")})
    for name, fn in (("elementwise", _elementwise), ("matmul", _matmuls), ("attention", _attention),
                     ("overhead", _overhead), ("adamw", _adamw), ("train", _trains),
                     ("runtime", _runtime_subprocess)):
        if sections and name not in sections:
            continue
        result.pop(name + "_error", None)
        t = time.time()
        try:
            result[name] = fn(dev)
        except Exception as e:  # one section failing still leaves the others' numbers
            result[name + "_error"] = f"{type(e).__name__}: {e}"
        print(f"{name}: {time.time() - t:.1f} s", flush=True)
        _write(path, result)  # after each section: a run cut short keeps the sections done
    return result


# --- comparing (anywhere: the preset's predictions) -----------------------------------------------------------
def compare(m: dict, hardware: str) -> None:
    import autopar
    from autopar.cost import optimizer_step_time, step_temporaries
    from autopar.hardware import get_hardware
    hw = get_hardware(hardware)
    rate = hw.hbm_bandwidth * hw.memory_efficiency
    print(f"{m['device']}, torch {m['torch']} (CUDA {m['cuda']}), measured {m['date']}; predicted by preset {hw.name!r}")
    print(f"\nelementwise (x * 2.0, {ELEMENTWISE_BYTES >> 20} MiB): bytes read + written per second")
    for dt, r in m.get("elementwise", {}).items():
        got = r["bytes"] / r["seconds"]
        print(f"  {dt:9s} measured {got / 1e12:5.2f} TB/s = {got / hw.hbm_bandwidth:.2f} of HBM  |  "
              f"preset {rate / 1e12:5.2f} TB/s (memory_efficiency {hw.memory_efficiency})  |  measured/preset {got / rate:.2f}")
    print(f"\nmatmul ({MATMUL_MK} x {MATMUL_MK}) @ ({MATMUL_MK} x d): FLOP/s as a share of the dtype's peak")
    for r in m.get("matmul", []):
        peak = hw.flops(r["dtype"])
        got = 2 * r["m"] * r["k"] * r["n"] / r["seconds"] / peak
        d = min(r["m"], r["k"], r["n"])
        want = hw.matmul_efficiency * d / (d + hw.matmul_half_dim)
        print(f"  {r['dtype']:9s} d={d:5d}  measured {got:.3f} ({got * peak / 1e12:6.1f} TFLOP/s)  |  preset {want:.3f}  "
              f"|  measured/preset {got / want:.2f}")
    print("\ncausal attention (SDPA, bf16): FLOP/s of the tiles the kernel runs, as a share of the bf16 peak")
    for r in m.get("attention", []):
        b, h, t, dh = r["shape"]
        n = -(-t // 128)
        work = 4 * b * h * t * t * dh * (n + 1) / (2 * n)
        peak = hw.flops("bfloat16")
        f = work / r["forward"] / peak
        fb = 3 * work / r["forward_backward"] / peak
        print(f"  B={b} H={h} T={t} D={dh}: forward {f:.3f}, forward + backward {fb:.3f}  |  preset "
              f"{hw.attention_efficiency:.3f}  |  measured/preset {fb / hw.attention_efficiency:.2f}")
    if "overhead" in m:
        o = m["overhead"]
        print(f"\nper-op overhead (eager, forward + backward of {o['ops']} tiny ops): "
              f"{o['seconds'] / (2 * o['ops']) * 1e6:.1f} us per op and direction  |  preset {hw.op_overhead * 1e6:.1f} us")
    print(f"\nAdamW step, {len(ADAMW_SIZES)} fp32 parameters of unequal sizes: time (preset: its kernel's "
          "optimizer_step_bytes per element at the elementwise rate) and temporaries (cost.step_temporaries)")
    stepped = [4.0 * n for n in ADAMW_SIZES]
    for r in m.get("adamw", []):
        kernel_hw = dataclasses.replace(hw, optimizer_kernel=r["kernel"])
        pred = optimizer_step_time(r["elements"], kernel_hw)
        temps = step_temporaries(stepped, r["kernel"])
        print(f"  {r['kernel']:8s}  {r['seconds'] * 1e3:7.2f} ms = {r['seconds'] * rate / r['elements']:5.1f} B/element "
              f"| predicted {pred * 1e3:6.2f} ms ({kernel_hw.step_bytes():g} B/element), measured/predicted "
              f"{r['seconds'] / pred:.2f}  "
              f"|  temporaries {r['temporaries'] / 2**20:7.1f} MiB, predicted {temps / 2**20:7.1f} MiB")
    print("\nwhole training steps on one device, measured (eager torch, and autopar's runtime on a one-rank mesh) and"
          " predicted (autopar.plan on a one-device mesh of the preset); measured/predicted in brackets")
    for r in m.get("train", []) + m.get("runtime", {}).get("train", []):
        run = {k: r[k] for k in ("model", "config", "batch", "seq", "precision", "kernel")}
        model, inputs = build(run, "meta")
        inputs = tuple(t.to("meta") for t in inputs)
        mp = autopar.MixedPrecision(torch.bfloat16, torch.float32) if run["precision"] == "bf16/fp32" else None
        mesh = autopar.Mesh({"dp": 1}, hardware=dataclasses.replace(hw, optimizer_kernel=run["kernel"]))
        c = autopar.plan(model, mesh, inputs, mixed_precision=mp).cost
        fb_pred = c.step_time - c.optimizer_time
        kept = c.memory_breakdown.get("state", 0.0) + c.memory_breakdown.get("activations", 0.0)
        print(f"  {r.get('runtime', 'eager'):7s} {run['model']} {run['precision']} batch {run['batch']} x {run['seq']}, "
              f"AdamW {run['kernel']}: forward+backward {r['forward_backward'] * 1e3:7.1f} ms, predicted {fb_pred * 1e3:7.1f} "
              f"({r['forward_backward'] / fb_pred:.2f})  |  step {r['optimizer'] * 1e3:6.2f} ms, predicted "
              f"{c.optimizer_time * 1e3:6.2f} ({r['optimizer'] / c.optimizer_time:.2f})  |  peak "
              f"{r['peak'] / 2**30:6.2f} GiB, predicted {c.memory_per_device / 2**30:6.2f} "
              f"({r['peak'] / c.memory_per_device:.3f})" + (
                  f"  |  after forward {r['after_forward'] / 2**30:6.2f} GiB, predicted state + activations "
                  f"{kept / 2**30:6.2f} ({r['after_forward'] / kept:.3f})" if "after_forward" in r else ""))
    if "runtime" in m:
        r = m["runtime"]
        print(f"\nautopar's runtime on this device (a one-rank mesh): losses (autopar, eager) per step {r['losses']}, "
              f"largest parameter difference after 3 steps {r['max_param_diff']:.2e}; seconds per step autopar "
              f"{r['autopar_step'] * 1e3:.2f} ms, eager {r['eager_step'] * 1e3:.2f} ms")
    for k in m:
        if k.endswith("_error"):
            print(f"\n{k}: {m[k]}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--measure", action="store_true", help="measure this machine's CUDA device 0")
    ap.add_argument("--json", help="the measurement's file (written with --measure, read without)")
    ap.add_argument("--hardware", default="h200", help="the preset to predict with")
    ap.add_argument("--sections", nargs="*", help="with --measure: only these (elementwise matmul attention overhead "
                    "adamw train runtime), replaced in --json's file")
    ap.add_argument("--runtime-check", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.runtime_check:
        print(json.dumps(runtime_check()))
        return
    if a.measure:
        if not torch.cuda.is_available():
            sys.exit("calibrate_gpu.py --measure needs a CUDA device; without --measure it prints a stored measurement")
        measure(a.json or "gpu.json", a.sections)
        return
    path = a.json or STORED.get(a.hardware)
    if not path or not os.path.exists(path):
        sys.exit(f"no measurement for {a.hardware!r}: run with --measure --json FILE on such a GPU, then --json FILE")
    compare(_read(path), a.hardware)


if __name__ == "__main__":
    main()
