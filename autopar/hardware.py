"""Hardware presets: what one device computes, holds and moves, and how fast its links are.

In: a preset name (``a100-80gb``, ``a100-40gb``, ``h100-80gb``, ``h100-500w``, ``h200``, ``cpu-gloo``) or a ``Hardware`` built by hand.
Out: a frozen ``Hardware``: peak FLOP/s per dtype, HBM bandwidth and size, devices per node, and two ``Link``s
(inside a node, across nodes) with an alpha-beta model (latency per ring step, bandwidth per device). A ring
collective across nodes over a group with k ranks in each node reaches k devices' share of the network (its rings
leave a node on k NICs: ``Hardware.rails``, ``Mesh.link``), up to NVLink's.

Sources: NVIDIA datasheets (dense tensor-core peaks, HBM); NVLink 3/4 per-GPU unidirectional bandwidth
(300 / 450 GB/s); one 200 Gb/s HDR (A100) or 400 Gb/s NDR (H100/H200) InfiniBand port per GPU. Efficiencies
(calibrated with ``benchmarks/plan_quality.py`` against Megatron-LM's SC'21 GPT ladder and GPT-3 175B runs and
torchtitan's Llama-3 runs on A100s): on an A100 a large matmul reaches 73% of peak and half of that at a thinnest
dimension of 128 -- the 73% is the one constant fitted on the ladder (Table 1, each row as Megatron-LM's artifact
scripts ran it: ``plan_quality.py --fit-matmul``), Table 2 and torchtitan's A100 runs check it --; FlashAttention-2
60% of the FLOPs it runs (causal: the tiles on and below the diagonal); collectives 65% of NVLink's and 90% of
InfiniBand's line rate. The H100/H200 presets (700 W SXM) keep the 68% the A100 was fitted with before (on the ladder
as it was then described: microbatches of one row, 1F1B, no dropout) and its other efficiencies, except NVLink 4's
collectives at 80% of its line rate (the 360 GB/s NCCL's maintainers expect in an 8-H100 node), and are checked,
not fitted (plan_quality's check rows): NVIDIA's DGX-H100 Llama3 8B FSDP and 70B TP 4 x PP 8 runs in FP8 are
predicted within 4%, and ``h100-500w``'s clocks were fitted with it. One H200 was measured with
``benchmarks/calibrate_gpu.py`` (its table prints preset beside measured): the elementwise rate is the preset's,
large bf16 matmuls reach 0.78 of peak (above the presets' 0.68 and 0.73, which hold what a whole step loses
besides), torch's SDPA forward + backward 0.45 (the h200 preset takes it); on whole training steps forward and backward measured 0.85x the prediction in fp32 and 1.07x under
bf16/fp32, the foreach optimizer step 1.05-1.06x, the peak 1.003x and 1.036x. torchtitan's published H100 runs were on 500 W parts with HBM2e: ``h100-500w`` describes them, with one
constant fitted (the tensor-core clocks the power limit leaves) on one of their runs and checked on the others.
The runtime fields (``overlap``, ``reduce_overlap``, ``grad_reduce_bytes``, ``attention_skips_masked``,
``attention_unfused``, ``selective_recomputes_every``, ``selective_keeps_gathers``, ``float8_linears``, ``tp_overlap``,
``fused_elementwise``)
describe autopar's runtime by default (no overlap priced,
gradients reduced in the parameter's dtype, SDPA's fused kernels, selective recomputation keeping every matmul's
output, the model's dtype, tensor-parallel collectives between the linears, not under them, one kernel per op;
ZeRO-3 gathered a block at a time, as FSDP2 does, is no field: every runtime priced does it); the benchmark sets
them to describe Megatron-LM, Megatron-Core, DeepSpeed and FSDP2 (with and without torch.compile) when it prices
their published runs. Hardware that sets those autopar's runtime does not realise
(``Hardware.foreign_runtime``) plans but does not run: ``parallelize`` refuses it and names the fields.

``cpu-gloo`` is one rank of 4 gloo processes (one thread each) sharing the 2-core development machine, the way the
tests, benchmarks and demo run them: a "device" is what one rank gets there, not what one process gets alone (run
with 2 ranks, a core each, a rank computes about twice as fast as this preset says). Measured with
``benchmarks/calibrate_cpu.py`` (medians of 4 runs on a quiet machine; the script re-measures and says how busy
the machine was), every time the slowest rank's:
- compute with every rank running at once (each gets ~half a core): fp32 matmul ~50 GFLOP/s per rank (one process
  alone ~100), bf16 ~225 GFLOP/s (alone ~460: AVX-512 BF16), elementwise ~2.4 GB/s (alone ~4.8); achieved rates,
  so the efficiencies are 1.0.
- torch's AdamW step ~4 ns per fp32 parameter element as a for-loop (torch's default on CPUs), 4 ranks at once:
  the time of 10 bytes at the elementwise rate (``optimizer_step_bytes``; its passes run in cache, allocating less
  than ``x * 2.0`` does); fused ~2 ns (5 bytes), foreach ~9.5 ns (23 bytes: its list of square roots, as large as
  every parameter, does not stay in cache).
- per-op overhead ~11 us per ATen op and direction (charged in forward and again in backward), 4 ranks at once.
- gloo over 127.0.0.1: all-reduce, all-gather and reduce-scatter of 4 KiB - 16 MiB on 4 ranks and on pairs, fitted
  to ``launch + steps * latency + wire / bandwidth``: ~0.4 ms launch, ~0.65 ms per ring step, ~1.1 GB/s; the launch
  also holds ~2.8 ms of late arrival (after compute rather than a barrier, the last of 4 ranks on 2 cores reaches
  a collective ~1-4 ms after the first). torch's gloo runs a reduce-scatter as an all-reduce of the whole buffer
  (``Link.reduce_scatter_as_all_reduce``; measured on 4 ranks at 16 MiB: reduce-scatter 29 ms, all-reduce 22 ms,
  all-gather 16 ms), and it is priced and fitted so; its 1-element all-reduce (a special path) takes ~10x less.
- no overlap priced: autopar's runtime gathers ZeRO-3 parameters a bucket ahead, beside the compute before them
  (FSDP2's prefetch; not credited: unmeasured, like the reductions' on GPUs); it runs each
  gradient reduction beside the backward that follows it (``collectives.settle``), but how much that hides is not
  measured on GPUs yet, so no GPU preset credits it (``reduce_overlap`` 0; conservative: a plan heavy in data
  parallelism is priced slower than it runs). On this machine ``calibrate_cpu.py`` measures it: a 4 MiB all-reduce
  launched beside as long a compute hides 0.01-0.29 of the shorter (four runs on 2026-12-03; the reduction's
  copying and summing run on the cores the compute needs). The stored preset keeps 0, measured on another machine without it.
- a pipeline stage alone in the bubble computes faster: the rates above are each rank's with all 4 computing,
  and while the other stage's ranks idle the busy ones get a core each (``cores_per_rank`` 0.5,
  ``busy_speedup``; the schedule is simulated so, ``schedule.simulate``'s ``speed``).
- gloo's all-gather and reduce-scatter reach less than its all-reduce (``Link.all_gather_bandwidth``,
  ``reduce_scatter_bandwidth``; 2026-12-03 on this host: 0.62-0.68x and 0.70-0.74x, fitted per kind); the stored
  preset has one bandwidth for all three, as it was fitted.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from autopar.errors import MeshError

OPTIMIZER_KERNELS = ("fused", "foreach", "for-loop")  # torch.optim's three implementations (torchtitan's names)
STEP_TRAFFIC = (("fused", 28.0), ("foreach", 80.0), ("for-loop", 80.0))  # bytes per element each moves (Hardware)
ADAMW_KWARGS = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}  # each's
# torch.optim.AdamW arguments


RING_KINDS = ("all_reduce", "all_gather", "reduce_scatter")  # the collectives NCCL runs as rings over a group's ranks


@dataclass(frozen=True)
class Link:
    """Alpha-beta model of one link class: ``time = launch + steps * latency + wire_bytes / bandwidth``."""

    bandwidth: float  # bytes/s per device, one direction, as achieved by collectives (efficiency included)
    latency: float  # seconds per ring step
    launch: float  # seconds of fixed overhead per collective call
    reduce_scatter_as_all_reduce: bool = False  # the library runs a reduce-scatter as an all-reduce of the whole
    # buffer, each rank keeping its chunk (torch's gloo backend: pytorch/pytorch#118911), twice a ring's bytes
    all_gather_bandwidth: float = 0.0  # an all-gather's own bandwidth where the library's reaches another than its
    # all-reduce's (torch's gloo: 0.62-0.68x, measured, benchmarks/calibrate_cpu.py); 0: ``bandwidth``
    reduce_scatter_bandwidth: float = 0.0  # a reduce-scatter's, likewise (gloo's, run as an all-reduce: 0.70-0.74x)
    ring_bandwidth: float = 0.0  # a ring collective's (all-reduce, all-gather, reduce-scatter) over a group with several
    # ranks in each node, whose rings leave each node through that many NICs at once (``Mesh.link``, ``Hardware.rails``);
    # 0: ``bandwidth``

    def rate(self, kind: str) -> float:
        """Bytes/s per device a collective of ``kind`` reaches on this link."""
        own = {"all_gather": self.all_gather_bandwidth, "reduce_scatter": self.reduce_scatter_bandwidth}.get(kind, 0.0)
        if own:
            return own
        return self.ring_bandwidth if self.ring_bandwidth and kind in RING_KINDS else self.bandwidth


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_flops: tuple[tuple[str, float], ...]  # dtype name -> dense FLOP/s
    hbm_bandwidth: float  # bytes/s
    memory: float  # bytes per device
    devices_per_node: int
    intra_node: Link
    inter_node: Link
    input_bandwidth: float = 25e9  # bytes/s a device's share of the batch arrives at (host to device)
    matmul_efficiency: float = 0.7  # fraction of peak a large matmul reaches
    matmul_half_dim: float = 0.0  # a matmul whose smallest dim is this reaches half of matmul_efficiency
    attention_efficiency: float = 0.7  # fraction of peak fused attention (forward and backward) reaches
    attention_skips_masked: bool = True  # a causal fused attention kernel skips the score tiles above the diagonal
    # (FlashAttention, SDPA's flash/efficient kernels: about half the work); unfused attention computes the whole
    # score matrix and masks it (``attention_unfused``). The model FLOPs (and so MFU) count the whole matrix either
    # way, as Megatron-LM's and torchtitan's MFU formulas do.
    attention_unfused: bool = False  # attention runs as Megatron-LM's and DeepSpeed's 2021 GPTs ran it, kernel by
    # kernel over the whole score matrix in memory (``cost.unfused_attention``): a batched matmul writes the scores,
    # one fused scale-mask-softmax reads and writes them, a second batched matmul reads them (a dropout pass between,
    # where the op has dropout), and backward likewise; attention_efficiency and attention_skips_masked then do not
    # apply. autopar's runtime calls SDPA's fused kernels
    memory_efficiency: float = 0.8  # fraction of HBM bandwidth an elementwise op reaches
    op_overhead: float = 0.0  # seconds per op launched (forward; backward pays it again), beyond its roofline time
    optimizer_step_bytes: "tuple[tuple[str, float], ...] | float" = STEP_TRAFFIC  # memory traffic of one AdamW
    # step per parameter element it steps, per implementation (``optimizer_kernel``), run at memory_efficiency of
    # hbm_bandwidth. Counted from torch's AdamW on fp32 (as much for a 16-bit parameter with an fp32 master copy):
    # fused, one kernel, reads the parameter, its gradient and two moments and writes the three back (7 x 4 bytes);
    # foreach and for-loop make eight passes (decay the parameter; lerp the first moment; scale and addcmul the
    # second; its square root, divided, plus eps, into a temporary; addcdiv into the parameter: 80 bytes). Checked on
    # an H200 (``benchmarks/calibrate_gpu.py``): 33, 87 and 77 bytes' time. A number gives every kernel the same;
    # cpu-gloo: measured per kernel (``benchmarks/calibrate_cpu.py``: its passes run in cache)
    optimizer_kernel: str = "foreach"  # how the user's AdamW runs its step, which decides what it allocates beside
    # the state and gradients (``cost.step_temporaries``): "fused" (one kernel: nothing; Megatron's, torchtitan's
    # default, ``fused=True``), "foreach" (torch's default on GPUs: one temporary per element it steps), "for-loop"
    # (``foreach=False``, torch's default on CPUs: two of one parameter beside the one before's)
    # How the runtime being priced behaves (autopar's own: no overlap priced, see the module docstring; a preset for FSDP2 / DeepSpeed runs sets
    # these to describe theirs). Like FSDP2, autopar's runtime gathers and reduce-scatters ZeRO-3 parameters a
    # block at a time (``collectives.zero3_gather``), so that is no field:
    overlap: float = 0.0  # fraction of the shorter of compute and data-parallel communication (gradient buckets,
    # ZeRO) hidden under the other: step = max(C, D) + (1 - overlap) min(C, D)
    grad_reduce_bytes: int = 0  # bytes per element gradients are reduced in (Megatron-LM's fp32 main grads, FSDP2's
    # reduce_dtype=float32 in torchtitan: 4); 0: the parameter's own dtype
    selective_recomputes_every: int = 0  # selective recomputation also recomputes every k-th matmul of a block
    # (torchtitan's op-level SAC saves every other mm: 2); 0: it keeps every matmul's output (autopar's)
    selective_keeps_gathers: bool = True  # selective recomputation keeps the outputs of a block's all-gathers
    # (autopar's policy keeps every collective's); False: it runs them again in backward and keeps none of them
    # (torchtitan's op-level SAC, whose list of ops to save holds the reduce-scatter but not the all-gather: under
    # tensor + sequence parallelism each block's gathered activations are gathered again, not kept)
    float8_linears: bool = False  # the repeated blocks' matmuls run in float8 with dynamic per-tensor scaling
    # (torchao's Float8Linear as torchtitan applies it: every linear but the output head), at the "float8" peak;
    # autopar's runtime does not (parallelize refuses such hardware)
    reduce_overlap: float = 0.0  # autopar's runtime (with ``overlap`` 0): fraction of the shorter of the rest of the
    # step and the gradient reductions it launches and waits for later (``collectives.settle``) hidden under the
    # other. Deferred is each bucket's last collective (an all-reduce, or a reduce-scatter where nothing is left to
    # sum), and hidden only where backward has work left after it: the buckets of every block but the first in
    # forward order (the rest's and the first block's launch as backward ends; ZeRO-1's one bucket too). 0: not
    # measured (GPUs); cpu-gloo: measured (``benchmarks/calibrate_cpu.py``)
    cores_per_rank: float = 0.0  # ranks sharing a node's cores (gloo processes of one thread each): the cores one
    # rank gets while every rank of the node computes, which the rates above are measured at (cpu-gloo: 4 ranks on
    # 2 cores, 0.5); a rank computing while others idle (a pipeline's bubble) gets up to a core
    # (``busy_speedup``; ``pipeline.evaluate`` simulates the schedule so, the cluster screen's analytic step does
    # not and prices such a pipeline a little slow). 0: each rank has a device of its own (GPUs)
    tp_overlap: float = 0.0  # fraction of a tensor-parallel collective's time hidden behind the linear it feeds or
    # follows (Transformer Engine's userbuffer overlap in Megatron-Core, torch's AsyncTP): all-gather + GEMM and
    # GEMM + reduce-scatter run as one pipelined kernel pair; 0: autopar's runtime runs them one after the other
    device_type: str = "cuda"  # the devices' torch device type, which decides the kernels an op runs and so what
    # its backward keeps (``cost.KERNEL_SAVES``: an RMSNorm keeps its input and one fp32 statistic per row in CUDA's
    # fused kernel, four fp32 copies of its input where it is composed of smaller ops, as on CPUs)
    fused_elementwise: bool = False  # torch.compile's Inductor fuses each chain of memory-bound ops of a repeated
    # block into one kernel: a value passed between two of them is neither written nor read back (torchtitan compiles
    # block by block); autopar's runtime runs each op as its own kernel
    rails: bool = True  # a ring collective (all-reduce, all-gather, reduce-scatter) over a group with k ranks in each
    # node crosses the nodes on k NICs at once, up to the node's NVLink (``Mesh.link``): NCCL runs one ring a channel,
    # each leaving the node through another NIC, the rest of its path on NVLink (NVIDIA/nccl#412, #569, #1168: 8 GPUs
    # over 4 or 2 nodes all-reduce 2.1x / 2.8x faster than over 8; 90 against 45 GB/s with 8 GPUs a node against 4).
    # False: one NIC's share a device whatever the group (``benchmarks/plan_quality.py``'s DeepSpeed ZeRO-3 of 2021,
    # whose step stays flat from 768 to 1536 GPUs)

    def __post_init__(self):
        traffic = self.optimizer_step_bytes
        if isinstance(traffic, (int, float)):
            traffic = {k: traffic for k in OPTIMIZER_KERNELS}
        traffic = dict(traffic)
        if sorted(traffic) != sorted(OPTIMIZER_KERNELS):
            raise MeshError(f"hardware {self.name!r}: optimizer_step_bytes names {sorted(traffic)}; give a number of "
                            f"bytes per element for each of {', '.join(OPTIMIZER_KERNELS)} (or one number for all)")
        object.__setattr__(self, "optimizer_step_bytes", tuple((k, float(traffic[k])) for k in OPTIMIZER_KERNELS))
        if self.optimizer_kernel not in OPTIMIZER_KERNELS:
            raise MeshError(f"hardware {self.name!r}: optimizer_kernel {self.optimizer_kernel!r} is not one of "
                            f"{', '.join(OPTIMIZER_KERNELS)}; say how the optimizer steps (torch.optim.AdamW(fused=True): "
                            "'fused'; its default on GPUs: 'foreach'; foreach=False, or its default on CPUs: 'for-loop')")
        if self.float8_linears and "float8" not in dict(self.peak_flops):
            raise MeshError(f"hardware {self.name!r} has float8_linears set but no float8 peak in peak_flops; add "
                            "(\"float8\", FLOP/s) or leave float8_linears off (an A100 has no float8 tensor cores)")

    def step_bytes(self) -> float:
        """Bytes of memory traffic per parameter element of one AdamW step as ``optimizer_kernel`` runs it."""
        return dict(self.optimizer_step_bytes)[self.optimizer_kernel]

    def adamw_kwargs(self) -> dict[str, bool]:
        """The arguments of ``torch.optim.AdamW`` that make it step as ``optimizer_kernel`` says (and so allocate what
        the plan prices): ``AdamW(params, lr=..., **hw.adamw_kwargs())``."""
        return dict(ADAMW_KWARGS[self.optimizer_kernel])

    def foreign_runtime(self) -> dict[str, object]:
        """The runtime fields set to describe a runtime other than autopar's (``FOREIGN_RUNTIME``), with their values:
        such hardware prices FSDP2, Megatron-Core or torch.compile, and is for planning and comparing only."""
        return {f: getattr(self, f) for f in FOREIGN_RUNTIME if getattr(self, f) != _AUTOPAR_RUNTIME[f]}

    def autopar_runtime(self) -> "Hardware":
        """This hardware as autopar's own runtime runs on it: the fields of ``foreign_runtime`` at their defaults."""
        return dataclasses.replace(self, **_AUTOPAR_RUNTIME) if self.foreign_runtime() else self

    def busy_speedup(self, busy: int, ranks: int) -> float:
        """How much faster a rank computes while only ``busy`` of the ``ranks`` ranks on its node compute than while
        all of them do: with ``cores_per_rank`` c < 1 it gets min(1, c ranks / busy) cores instead of c; 1 on
        devices of their own."""
        c = self.cores_per_rank
        if c <= 0.0 or c >= 1.0 or busy >= ranks:
            return 1.0
        return min(1.0, c * ranks / busy) / c

    def group_speedups(self, ranks: int, groups: int) -> "list[float] | None":
        """``ranks`` ranks in ``groups`` equal groups (a pipeline's stages): per k = 1..groups, ``busy_speedup`` while
        k groups compute; None where it is 1 throughout: devices of their own, or ranks over more than one node
        (a node then holds fewer groups' ranks, pp being outermost: not modelled, conservatively)."""
        if ranks > self.devices_per_node:
            return None
        speeds = [self.busy_speedup(k * (ranks // groups), ranks) for k in range(1, groups + 1)]
        return speeds if any(s != 1.0 for s in speeds) else None

    def reduce_factor(self, dtype: torch.dtype) -> float:
        """Gradient bytes on the wire per byte of the parameter's dtype."""
        return self.grad_reduce_bytes / dtype.itemsize if self.grad_reduce_bytes else 1.0

    def flops(self, dtype: "torch.dtype | str") -> float:
        table = dict(self.peak_flops)
        key = dtype if isinstance(dtype, str) else str(dtype).replace("torch.", "")
        return table.get(key, table["float32"])

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "peak_flops": dict(self.peak_flops),
            "hbm_bandwidth": self.hbm_bandwidth,
            "memory": self.memory,
            "devices_per_node": self.devices_per_node,
            "intra_node": vars(self.intra_node),
            "inter_node": vars(self.inter_node),
            "input_bandwidth": self.input_bandwidth,
            "matmul_efficiency": self.matmul_efficiency,
            "memory_efficiency": self.memory_efficiency,
            "matmul_half_dim": self.matmul_half_dim,
            "attention_efficiency": self.attention_efficiency,
            "attention_skips_masked": self.attention_skips_masked,
            "attention_unfused": self.attention_unfused,
            "op_overhead": self.op_overhead,
            "optimizer_step_bytes": dict(self.optimizer_step_bytes),
            "optimizer_kernel": self.optimizer_kernel,
            "overlap": self.overlap,
            "reduce_overlap": self.reduce_overlap,
            "cores_per_rank": self.cores_per_rank,
            "grad_reduce_bytes": self.grad_reduce_bytes,
            "selective_recomputes_every": self.selective_recomputes_every,
            "selective_keeps_gathers": self.selective_keeps_gathers,
            "float8_linears": self.float8_linears,
            "tp_overlap": self.tp_overlap,
            "fused_elementwise": self.fused_elementwise,
            "rails": self.rails,
            "device_type": self.device_type,
        }

    @staticmethod
    def from_json(d: dict) -> "Hardware":
        """The Hardware ``to_json`` wrote (a dict, e.g. ``json.load(f)``); a field missing, of the wrong kind, or a
        rate or size that is not a positive number is an error naming it."""
        if not isinstance(d, dict):
            raise MeshError(f"Hardware.from_json takes the dict Hardware.to_json writes (json.load(f)); got {type(d).__name__}")
        try:
            hw = Hardware._from_json(d)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            what = f"field {e.args[0]!r} is missing" if isinstance(e, KeyError) else f"{type(e).__name__}: {e}"
            raise MeshError(f"hardware {d.get('name', '?')!r} from JSON: {what}; give every field Hardware.to_json writes") from None

        def positive(v) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < float("inf")
        bad = [k for k in ("hbm_bandwidth", "memory", "devices_per_node", "input_bandwidth", "matmul_efficiency", "memory_efficiency")
               if not positive(getattr(hw, k))]
        bad += [f"{side}.bandwidth" for side in ("intra_node", "inter_node") if not positive(getattr(hw, side).bandwidth)]
        bad += [f"peak_flops[{k!r}]" for k, v in hw.peak_flops if not positive(v)]
        if bad or not hw.peak_flops or "float32" not in dict(hw.peak_flops):
            what = ", ".join(bad) if bad else "peak_flops needs a 'float32' entry"
            raise MeshError(f"hardware {hw.name!r} from JSON: {what} must each be a positive number (FLOP/s, bytes/s, bytes)"
                            if bad else f"hardware {hw.name!r} from JSON: {what}")
        return hw

    @staticmethod
    def _from_json(d: dict) -> "Hardware":
        return Hardware(
            name=d["name"],
            peak_flops=tuple(d["peak_flops"].items()),
            hbm_bandwidth=d["hbm_bandwidth"],
            memory=d["memory"],
            devices_per_node=d["devices_per_node"],
            intra_node=Link(**d["intra_node"]),
            inter_node=Link(**d["inter_node"]),
            input_bandwidth=d["input_bandwidth"],
            matmul_efficiency=d["matmul_efficiency"],
            memory_efficiency=d["memory_efficiency"],
            matmul_half_dim=d.get("matmul_half_dim", 0.0),
            attention_efficiency=d.get("attention_efficiency", 0.7),
            attention_skips_masked=bool(d.get("attention_skips_masked", True)),
            attention_unfused=bool(d.get("attention_unfused", False)),
            op_overhead=d.get("op_overhead", 0.0),
            optimizer_step_bytes=d.get("optimizer_step_bytes", STEP_TRAFFIC),  # a number: every kernel's
            optimizer_kernel=str(d.get("optimizer_kernel", "foreach")),
            overlap=float(d.get("overlap", 0.0)),
            reduce_overlap=float(d.get("reduce_overlap", 0.0)),
            cores_per_rank=float(d.get("cores_per_rank", 0.0)),
            grad_reduce_bytes=int(d.get("grad_reduce_bytes", 0)),
            selective_recomputes_every=int(d.get("selective_recomputes_every", 0)),
            selective_keeps_gathers=bool(d.get("selective_keeps_gathers", True)),
            float8_linears=bool(d.get("float8_linears", False)),
            tp_overlap=float(d.get("tp_overlap", 0.0)),
            fused_elementwise=bool(d.get("fused_elementwise", False)),
            rails=bool(d.get("rails", True)),
            device_type=str(d.get("device_type", "cuda")),
        )


_GB = 1e9  # decimal, as vendors state sizes and rates. A preset's memory is the vendor's figure in these units
# (an "80 GB" part: 80e9 bytes, 74.5 GiB, of the 79.2-79.6 GiB a process can allocate there): the ~5 GiB left over
# stand for what plans do not price -- the CUDA context, NCCL's buffers, the caching allocator's fragmentation
# runtime fields autopar's own runtime does not realise (its gathers wait, and the hiding of its reductions is
# not measured; it reduces gradients in their dtype, runs linears in the model's dtype, one kernel per op, attention
# in SDPA's fused kernels, and its selective recomputation keeps the gathers): set, they price another runtime,
# and parallelize refuses such hardware rather than run a plan whose every number describes something else
FOREIGN_RUNTIME = ("overlap", "grad_reduce_bytes", "float8_linears", "tp_overlap", "fused_elementwise",
                   "attention_unfused", "selective_keeps_gathers")
_AUTOPAR_RUNTIME = {f.name: f.default for f in dataclasses.fields(Hardware) if f.name in FOREIGN_RUNTIME}

H100_500W_CLOCKS = 0.71  # share of the 700 W H100's tensor-core peak a 500 W limit leaves ("h100-500w" below)

PRESETS: dict[str, Hardware] = {
    "a100-80gb": Hardware(
        name="a100-80gb",
        peak_flops=(("bfloat16", 312e12), ("float16", 312e12), ("float32", 19.5e12)),
        hbm_bandwidth=2.0e12,
        memory=80 * _GB,
        devices_per_node=8,
        intra_node=Link(bandwidth=0.65 * 300 * _GB, latency=5e-6, launch=10e-6),
        inter_node=Link(bandwidth=0.9 * 25 * _GB, latency=10e-6, launch=15e-6),
        matmul_efficiency=0.73,  # fitted on SC'21's ladder as it ran (benchmarks/plan_quality.py --fit-matmul: 0.731)
        matmul_half_dim=128,
        attention_efficiency=0.6,  # FlashAttention-2 through SDPA: ~70% of peak forward, ~55% backward
    ),
    "h100-80gb": Hardware(
        name="h100-80gb",
        peak_flops=(("bfloat16", 989e12), ("float16", 989e12), ("float32", 67e12), ("float8", 1979e12)),
        hbm_bandwidth=3.35e12,
        memory=80 * _GB,
        devices_per_node=8,
        # NVLink 4 through NVSwitch: NCCL's rings reach a bus bandwidth of 360 GB/s in a node of 8 H100s (0.8 of the
        # 450 GB/s each way), which NCCL's maintainers give as what an H100 node is expected to reach
        # (NVIDIA/nccl-tests#326); the A100's 0.65 is what its nodes measure (~200 GB/s of 300, nccl-tests#149)
        intra_node=Link(bandwidth=0.8 * 450 * _GB, latency=4e-6, launch=10e-6),
        inter_node=Link(bandwidth=0.9 * 50 * _GB, latency=8e-6, launch=15e-6),
        matmul_efficiency=0.68,  # the A100's earlier calibration, checked on DGX-H100 runs (plan_quality --cases check)
        matmul_half_dim=128,
        attention_efficiency=0.6,  # FlashAttention-2 through SDPA: ~70% of peak forward, ~55% backward
    ),
    "h200": Hardware(
        name="h200",
        peak_flops=(("bfloat16", 989e12), ("float16", 989e12), ("float32", 67e12), ("float8", 1979e12)),
        hbm_bandwidth=4.8e12,
        memory=141 * _GB,
        devices_per_node=8,
        intra_node=Link(bandwidth=0.8 * 450 * _GB, latency=4e-6, launch=10e-6),  # NVLink 4, as the H100's
        inter_node=Link(bandwidth=0.9 * 50 * _GB, latency=8e-6, launch=15e-6),
        matmul_efficiency=0.68,  # the A100's earlier calibration, checked on DGX-H100 runs (plan_quality --cases check)
        matmul_half_dim=128,
        attention_efficiency=0.45,  # torch's SDPA (FlashAttention-2) forward + backward, causal, bf16, head dim 128,
        # measured on an H200 (benchmarks/calibrate_gpu.py, 2026-12-04): 0.45 at 8K tokens, 0.40 at 4K; the A100's
        # 0.6 is not reached on Hopper without FlashAttention-3
    ),
    "cpu-gloo": Hardware(  # one rank of 4 sharing the 2-core machine; benchmarks/calibrate_cpu.py (module docstring)
        name="cpu-gloo",
        peak_flops=(("bfloat16", 225e9), ("float32", 50e9)),
        hbm_bandwidth=2.4 * _GB,
        memory=24 * _GB,
        devices_per_node=64,
        intra_node=Link(bandwidth=1.1 * _GB, latency=650e-6, launch=3.2e-3, reduce_scatter_as_all_reduce=True),
        inter_node=Link(bandwidth=1.1 * _GB, latency=650e-6, launch=3.2e-3, reduce_scatter_as_all_reduce=True),
        input_bandwidth=2.4 * _GB,
        matmul_efficiency=1.0,
        attention_efficiency=1.0,
        memory_efficiency=1.0,
        op_overhead=11e-6,
        optimizer_step_bytes=(("fused", 5.1), ("foreach", 22.8), ("for-loop", 10.0)),  # bytes' time per element at
        # the elementwise rate: the for-loop's ~4.2 ns per element (2026-12-04 as before), fused and foreach's 2.1 and
        # 9.5 ns measured beside it in the same run (foreach's list of temporaries leaves the cache)
        optimizer_kernel="for-loop",  # torch's AdamW on CPU tensors by default
        cores_per_rank=0.5,  # 4 ranks of one thread on 2 cores
        device_type="cpu",
    ),
}

# An H100 SXM with 96 GB of HBM2e (2.4 TB/s) held to a 500 W power limit, as in Meta's Grand Teton hosts where
# torchtitan's published H100 runs were made: the clocks the limit allows reach 0.71 of the 700 W part's
# tensor-core peaks (fitted on one run: torchtitan's Llama-3.1 8B, FSDP 8, torch.compile, bf16 -- plan_quality
# --cases check refits it and prices the page's other runs with it), and torch's SDPA ran FlashAttention-2,
# which reaches 35% of an H100's peak (Shah et al., FlashAttention-3, 2024), not the 60% it reaches on an A100
PRESETS["h100-500w"] = dataclasses.replace(
    PRESETS["h100-80gb"], name="h100-500w", hbm_bandwidth=2.4e12, memory=96 * _GB, attention_efficiency=0.35,
    peak_flops=tuple((k, v * H100_500W_CLOCKS) for k, v in PRESETS["h100-80gb"].peak_flops))

# the A100's 40 GB part (HBM2 at 1.555 TB/s, the datasheet's), otherwise the 80 GB preset: same clocks, NVLink 3 and
# one 200 Gb/s port a GPU; checked, not fitted, on MosaicML's FSDP runs of 2023 (plan_quality's check rows)
PRESETS["a100-40gb"] = dataclasses.replace(PRESETS["a100-80gb"], name="a100-40gb", hbm_bandwidth=1.555e12, memory=40 * _GB)


def get_hardware(hw: "str | Hardware") -> Hardware:
    if isinstance(hw, Hardware):
        return hw
    if hw not in PRESETS:
        raise MeshError(f"unknown hardware preset {hw!r}; known presets: {', '.join(PRESETS)}")
    return PRESETS[hw]
