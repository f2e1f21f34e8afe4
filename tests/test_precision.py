"""Mixed precision (FSDP2's MixedPrecisionPolicy): every ZeRO stage, tensor and pipeline parallelism train as one
device does under the same policy; the program computes in the param dtype, gathers in it, reduces in the reduce
dtype, and hands gradients to the master parameters in theirs -- what the plan priced, collective for collective.

Exactness: a float64 model computing in float32 matches one device computing in float32 to float32's rounding of
different summation orders; a float64 program (the policy ignored) would give float64 losses, which the tests
catch by dtype."""

from __future__ import annotations

import collections
import copy
import dataclasses
import warnings

import pytest
import torch

import autopar
from autopar import _compat, collectives
from autopar.errors import AutoparError, PlanMismatchError
from autopar.pipeline import PipelinePin
from models.gpt import GPT, GPTConfig
from models.llama import Llama, LlamaConfig
from autopar.precision import SingleDevice
from tests._util import accumulate_beside, fake_world, parity
from tests.test_parity import megatron_pins

FP32_IN_FP64 = autopar.MixedPrecision(torch.float32)  # reduce dtype: the param dtype's, FSDP2's default
BF16 = autopar.MixedPrecision(torch.bfloat16, torch.float32)  # torchtitan's


def _model(name: str, layers: int = 2, dtype=torch.float64):
    torch.manual_seed(0)
    model = GPT(dataclasses.replace(GPTConfig.tiny(), n_layer=layers)) if name == "gpt" else Llama(dataclasses.replace(LlamaConfig.tiny(), n_layer=layers))
    return model.to(dtype)


def _inputs(rows: int = 4):
    x = torch.randint(0, 64, (rows, 16), generator=torch.Generator().manual_seed(1))
    return x, torch.roll(x, -1, 1)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_every_zero_stage_trains_as_one_device_under_the_policy(stage):
    """fp64 master parameters, fp32 compute, gradients reduced in fp32 and handed back in fp64 (the reduction's
    buffer is waited before that cast: the last collective is still writing it)."""
    r = parity(_model("gpt"), _inputs(), {"dp": 2}, constraints=[autopar.ZeroPin("*", stage)], mixed_precision=FP32_IN_FP64)
    assert r["plan"].mixed_precision == FP32_IN_FP64 and {s for s, _ in r["plan"].zero_stages.values()} == {stage}
    assert r["dtypes"] == {torch.float32, torch.float64}  # the loss computed in fp32; parameters and gradients fp64
    assert max(r["loss"], r["grad"], r["param"]) <= 1e-5, r


@pytest.mark.parametrize("name,stage", [("gpt", 1), ("llama", 3)])
def test_tensor_parallel_with_zero_under_the_policy(name, stage):
    axes = {"dp": 2, "tp": 2}
    r = parity(_model(name), _inputs(), axes, constraints=megatron_pins(name, axes) + [autopar.ZeroPin("*", stage)],
               mixed_precision=autopar.MixedPrecision(torch.float32, torch.float64))
    assert r["dtypes"] == {torch.float32, torch.float64}
    assert max(r["loss"], r["grad"], r["param"]) <= 1e-5, r


def test_floating_inputs_are_cast_to_the_param_dtype_and_outputs_left_as_computed():
    """An MLP regression (float inputs and targets) under tensor parallelism with its sharded weights reduced over
    nothing: the inputs are cast as FSDP2's ``cast_forward_inputs`` does, and the weights no data-parallel
    reduction touches are read through the program's own cast."""
    from models.mlp import MLP, MLPConfig

    torch.manual_seed(0)
    model = MLP(MLPConfig.tiny()).double()
    x = torch.randn(8, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    pins = [("layers.*.up.weight", "S(0)"), ("layers.*.down.weight", "S(1)")]  # Megatron's MLP: sharded, never summed
    r = parity(model, (x, torch.randn(8, 16, dtype=torch.float64)), {"tp": 2}, constraints=pins, mixed_precision=FP32_IN_FP64)
    assert any(n.target is collectives.cast for n in r["graph_module"].graph.nodes)
    assert r["dtypes"] == {torch.float32, torch.float64}
    assert max(r["loss"], r["grad"], r["param"]) <= 1e-5, r


@pytest.mark.parametrize("zero", [0, 1])
def test_a_pipeline_trains_as_one_device_under_the_policy(zero):
    """The stages cast what they read; ZeRO-1 gathers the shards in fp32 and holds them in fp64, so the
    microbatches' gradients accumulate in fp64; the sync after the schedule reduces in the reduce dtype."""
    r = parity(_model("gpt", 4), _inputs(8), {"dp": 2, "pp": 2}, constraints=[PipelinePin("1f1b", 2), autopar.ZeroPin("*", zero)],
               mixed_precision=FP32_IN_FP64)
    assert r["dtypes"] == {torch.float32, torch.float64}
    assert max(r["loss"], r["grad"], r["param"]) <= 1e-5, r


def test_bf16_compute_with_fp32_masters_and_reduction_tracks_one_device():
    """torchtitan's policy on an fp32 model: bf16 forward and backward, fp32 reduce-scatters, fp32 AdamW. The ranks'
    bf16 partial gradients summed in fp32 round differently from one device's whole-batch bf16 gradient, so the
    bound is bf16's: the loss within one bf16 step at 4 (1/32), gradients within 1e-3 (measured: 2e-4). (AdamW's
    steps, of size lr whatever a gradient's magnitude, turn that rounding on near-zero gradients into parameter
    differences of the order of the steps themselves: those are checked exactly in fp32 above.)"""
    r = parity(_model("llama", dtype=torch.float32), _inputs(), {"dp": 2}, constraints=[autopar.ZeroPin("*", 3)], mixed_precision=BF16)
    assert r["dtypes"] == {torch.bfloat16, torch.float32}
    assert r["loss"] <= 1 / 32 and r["grad"] <= 1e-3, r


@pytest.mark.parametrize("name,stage", [("gpt", 0), ("gpt", 1), ("gpt", 2), ("gpt", 3), ("llama", 3)])
def test_the_program_launches_what_the_plan_priced_in_each_dtype(name, stage):
    """bf16 gathers (half the bytes of the fp32 model's), fp32 reductions (the same bytes), and the plan prices
    exactly those: its reduce dtype prices the gradient buckets (``Hardware.grad_reduce_bytes``)."""
    axes = {"dp": 2, "tp": 2}
    pins = megatron_pins(name, axes) + [autopar.ZeroPin("*", stage)]
    model, x = _model(name, dtype=torch.float32), _inputs()
    mesh = autopar.Mesh(axes, hardware="h100-80gb")
    plain = autopar.plan(model, mesh, x, constraints=pins)
    with fake_world(mesh.size), _compat.local_tensor_mode(mesh.size):
        pm = autopar.parallelize(model, mesh, x, constraints=pins, mixed_precision=BF16)
        with collectives.record() as log:
            pm(*pm.local_inputs(*x)).backward()
    launched = collections.Counter((c.kind, c.axis, c.bytes, c.phase) for c in log)
    priced = collections.Counter((c.kind, c.axis, c.bytes, c.phase) for c in pm.plan.collectives())
    assert launched == priced

    def dp_bytes(plan, kind):
        return sum(c.bytes for c in plan.collectives() if c.axis == "dp" and c.kind == kind)

    reduce = "all_reduce" if stage == 0 else "reduce_scatter"
    assert dp_bytes(pm.plan, reduce) == dp_bytes(plain, reduce) > 0
    # (to the element but for a redistribution or two of the plans' own: the two plans are solved apart)
    assert stage == 0 or 2 * dp_bytes(pm.plan, "all_gather") == pytest.approx(dp_bytes(plain, "all_gather"), rel=0.01)
    assert pm.plan.mesh == mesh and "mixed precision bf16 compute, fp32 reduce" in pm.plan.summary()


@pytest.mark.parametrize("stage", [0, 3])
def test_gradients_held_under_no_sync_are_reduced_once_in_the_reduce_dtype(stage):
    model, first = _model("gpt"), _inputs()
    reference = SingleDevice(copy.deepcopy(model), FP32_IN_FP64)
    batches = [first] + [tuple(torch.roll(t, k, 0) for t in first) for k in (1, 2)]
    with fake_world(2), _compat.local_tensor_mode(2) as ltm:
        pm = autopar.parallelize(model, autopar.Mesh({"dp": 2}), first, constraints=[autopar.ZeroPin("*", stage)], mixed_precision=FP32_IN_FP64)
        logs = accumulate_beside(pm, reference, batches, 2, ltm)
        assert {p.grad.dtype for p in pm.parameters()} == {torch.float64}
    reduced = [[c for c in log if c.kind != "all_gather"] for log in logs]
    assert reduced[0] == reduced[1] == [] and reduced[2]


def test_a_pipeline_accumulates_fp32_main_gradients_over_steps_under_no_sync():
    """On dp2 x pp2 with ZeRO-1 the stages read bf16-like compute copies (fp32 here, of fp64 masters) made once a
    step, and each microbatch's gradient is added to an fp64 main gradient as it lands (Megatron-LM's main_grad):
    three steps, the first two under no_sync, give one device's sums."""
    model, first = _model("gpt", 4), _inputs(8)
    reference = SingleDevice(copy.deepcopy(model), FP32_IN_FP64)
    batches = [first] + [tuple(torch.roll(t, k, 0) for t in first) for k in (1, 2)]
    with fake_world(4), _compat.local_tensor_mode(4) as ltm:
        pm = autopar.parallelize(model, autopar.Mesh({"dp": 2, "pp": 2}), first, constraints=[PipelinePin("1f1b", 2), autopar.ZeroPin("*", 1)],
                                 mixed_precision=FP32_IN_FP64)
        logs = accumulate_beside(pm, reference, batches, 2, ltm)
        assert {p.grad.dtype for p in pm.parameters()} == {torch.float64} and not pm._pipe.main
    reduced = [sum(c.bytes for c in log if c.axis == "dp" and c.kind != "all_gather") for log in logs]
    assert reduced[:2] == [0, 0] and reduced[2] > 0, reduced


def test_the_users_model_is_left_as_it_was_and_the_plan_says_its_policy():
    model = _model("gpt")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    mesh = autopar.Mesh({"dp": 2})
    planned = autopar.plan(model, mesh, _inputs(), mixed_precision=BF16)
    again = autopar.Plan.from_json(planned.to_json())
    assert again.mixed_precision == BF16 and str(BF16) == "bf16 compute, fp32 reduce"
    with fake_world(2), _compat.local_tensor_mode(2):
        pm = autopar.parallelize(model, mesh, _inputs(), plan=again)
        pm(*pm.local_inputs(*_inputs())).backward()
        assert pm.plan.mixed_precision == BF16
        assert {n: p.dtype for n, p in pm.named_parameters()} == {n: torch.float64 for n, _ in model.named_parameters()}
    assert all(torch.equal(before[k], v) and v.dtype == before[k].dtype for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


def test_policy_errors_are_clear():
    with pytest.raises(AutoparError, match="param_dtype=torch.int8: give a floating dtype"):
        autopar.MixedPrecision(torch.int8)
    assert autopar.MixedPrecision("bf16", "float32") == BF16
    mesh = autopar.Mesh({"dp": 2})
    with pytest.raises(AutoparError, match="parameter wte.weight is torch.bfloat16, narrower than .* float32"):
        autopar.plan(_model("gpt", dtype=torch.bfloat16), mesh, _inputs(), mixed_precision=FP32_IN_FP64)
    with pytest.raises(AutoparError, match="give autopar.MixedPrecision"):
        autopar.plan(_model("gpt"), mesh, _inputs(), mixed_precision=torch.bfloat16)
    planned = autopar.plan(_model("gpt"), mesh, _inputs(), mixed_precision=BF16)
    with fake_world(2), pytest.raises(PlanMismatchError, match="differs from the plan's"):
        autopar.parallelize(_model("gpt"), mesh, _inputs(), plan=planned, mixed_precision=FP32_IN_FP64)


def test_a_handwritten_strategy_runs_under_the_policy_as_priced():
    model, x = _model("gpt", dtype=torch.float32), _inputs()
    mesh = autopar.Mesh({"dp": 2, "tp": 2}, hardware="h100-80gb")
    hw = autopar.handwritten(model, mesh, x, "megatron", zero=3, mixed_precision=BF16)
    assert hw.mixed_precision == BF16 and hw.mesh == mesh and hw.label == "megatron(zero=3)"
    with fake_world(mesh.size), _compat.local_tensor_mode(mesh.size):
        pm = autopar.parallelize(model, mesh, x, plan=hw)
        with collectives.record() as log:
            pm(*pm.local_inputs(*x)).backward()
    assert collections.Counter((c.kind, c.axis, c.bytes) for c in log) == collections.Counter((c.kind, c.axis, c.bytes) for c in hw.collectives())


def test_sixteen_bit_parameters_without_the_policy_are_warned_about():
    """A bf16 model without mixed_precision trains in bf16 (its AdamW state too), which the plan does not price
    (it prices 16-bit parameters as mixed precision holds them): parallelize says so, and what to do."""
    with fake_world(2), _compat.local_tensor_mode(2):
        with pytest.warns(UserWarning, match="wte.weight is torch.bfloat16 and no mixed_precision is given.*MixedPrecision"):
            autopar.parallelize(_model("gpt", dtype=torch.bfloat16), autopar.Mesh({"dp": 2}), _inputs())
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            autopar.parallelize(_model("gpt", dtype=torch.float32), autopar.Mesh({"dp": 2}), _inputs(), mixed_precision=BF16)


def test_the_compute_twin_has_dicts_of_its_own_so_nothing_done_to_it_reaches_the_model():
    from autopar.precision import compute_twin

    model = _model("llama")
    twin = compute_twin(model, BF16)
    pairs = list(zip(model.modules(), twin.modules()))
    assert all(a is not b and a._buffers is not b._buffers and a._parameters is not b._parameters for a, b in pairs)
    twin.layers[0].register_buffer("probe", torch.zeros(1))  # what export's swaps do, on the copy
    twin.layers[0].attention.wq.weight = torch.nn.Parameter(torch.zeros(1))
    assert "probe" not in dict(model.named_buffers()) and model.layers[0].attention.wq.weight.dtype == torch.float64


def test_a_cluster_plan_prices_the_reduction_in_the_policys_reduce_dtype_not_the_presets():
    """The cluster search traces the model as the policy computes it, and its meshes reduce in the policy's reduce
    dtype whatever the hardware preset says (``h100-80gb`` gives none, torchtitan's preset fp32)."""
    from autopar.cluster import Cluster

    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=4096, block_size=256, n_layer=4, n_head=8, n_embd=256))
    x = torch.empty(16, 256, dtype=torch.long, device="meta")
    plans = {mp: autopar.plan(model, Cluster(1, 8, "h100-80gb"), (x, x), mixed_precision=mp)
             for mp in (BF16, autopar.MixedPrecision(torch.bfloat16))}
    assert {mp: p.mesh.hardware.grad_reduce_bytes for mp, p in plans.items()} == {BF16: 4, autopar.MixedPrecision(torch.bfloat16): 2}
    wide, narrow = (plans[BF16].collectives(), plans[autopar.MixedPrecision(torch.bfloat16)].collectives())
    reduced = [sum(c.bytes for c in log if c.kind in ("all_reduce", "reduce_scatter") and c.axis == "dp") for log in (wide, narrow)]
    assert reduced[1] > 0 and reduced[0] == 2 * reduced[1], reduced


def test_reduced_gradients_are_cast_to_their_masters_only_after_their_reduction_lands():
    """The cast reads the buffer the bucket's last collective writes. In one process (LocalTensorMode) collectives
    finish before they return, so this stands in for an asynchronous one: its result lands when it is waited."""

    class Landing(collectives.Pending):
        def wait(self):
            if self.buffer is not None:
                self.buffer.copy_(torch.arange(6.0))
            super().wait()

    for masters, waited in (((torch.float64,) * 2, True), ((torch.float32,) * 2, False)):
        pending, flat = Landing(), torch.zeros(6)
        pending.launched(flat)
        out = collectives._as_masters([flat[:2], flat[2:]], masters, pending)
        assert [g.dtype for g in out] == list(masters)
        # a cast waits for its values; without one the views are handed on, and their bucket's settle waits
        assert [g.tolist() for g in out] == ([[0, 1], [2, 3, 4, 5]] if waited else [[0, 0], [0, 0, 0, 0]])
        assert (pending.buffer is None) == waited


def test_zero0_prices_the_compute_copy_autograd_keeps_and_a_frozen_parameters_master():
    """Under mixed precision a ZeRO-0 parameter is read through a bf16 copy of its fp32 master, which a linear keeps
    for its backward: activations count it (measured at batch 4096 on 4 gloo ranks, ``benchmarks/zero_memory.py``:
    predicted/measured 0.955 without it, 0.994 with it). A frozen parameter holds its fp32 master (and its copy),
    not bf16 bytes."""
    from models.mlp import MLP, MLPConfig

    model = MLP(MLPConfig(dim=64, hidden=256, n_layer=2))
    x = torch.randn(8, 64)
    mesh = autopar.Mesh({"dp": 2})
    numel = sum(p.numel() for p in model.parameters())

    def breakdown(**kw):
        return autopar.plan(model, mesh, (x, x), constraints=[autopar.ZeroPin("*", 0)], **kw).cost.memory_breakdown

    inputs = 2 * (x.numel() // 2) * 2  # a rank's share of the two inputs, 2 bytes less each element in bf16
    for freeze in (False, True):
        model.layers[0].requires_grad_(not freeze)
        fp32, mixed = breakdown(), breakdown(mixed_precision=BF16)
        assert mixed["activations"] - fp32["activations"] / 2 == pytest.approx(2 * numel)  # bf16 activations + copies
        # fp32 masters (and AdamW moments) either way, frozen or not
        assert fp32["state"] - mixed["state"] == pytest.approx(inputs), freeze


class _Normed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.norm, self.down = torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), torch.nn.Linear(32, 16)

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.down(torch.relu(self.norm(self.up(x)))), y)


def _normed_inputs(dtype=torch.float32):
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 16, generator=g, dtype=dtype), torch.randn(8, 16, generator=g, dtype=dtype)


@pytest.mark.parametrize("stage", [0, 3])
def test_a_batchnorm_reads_its_weights_in_its_statistics_dtype_under_a_16_bit_policy(stage):
    """torch's batch norm takes a bf16 input beside fp32 weight, bias and running statistics, but refuses bf16
    weights beside fp32 statistics: planned, such a model failed at its first step with torch's dtype error. Its
    weight and bias are now read cast back to the statistics' dtype (FSDP1 keeps BatchNorm in full precision), as
    the single-device reference reads them; the running statistics stay fp32 and move as one device's."""
    torch.manual_seed(0)
    model = _Normed()
    r = parity(model, _normed_inputs(), {"dp": 2}, constraints=[autopar.ZeroPin("*", stage)], mixed_precision=BF16)
    assert r["dtypes"] == {torch.bfloat16, torch.float32}
    assert r["loss"] <= 1 / 32 and r["grad"] <= 1e-3, r
    assert model.norm.running_mean.dtype == torch.float32


def test_a_batchnorm_whose_statistics_no_kernel_takes_is_refused():
    """fp64 statistics beside an fp32 input: no torch batch norm kernel takes them (nor fp32 weights with them), so
    the plan is refused, naming the module and the fixes, instead of failing at the first step."""
    model = _Normed().double()
    with pytest.raises(AutoparError, match=r"norm \(BatchNorm1d\) keeps running statistics in torch.float64.*float32"):
        autopar.plan(model, autopar.Mesh({"dp": 2}), _normed_inputs(torch.float64), mixed_precision=FP32_IN_FP64)
