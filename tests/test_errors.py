"""Bad input gets a clear autopar error (what, where, how to fix), and the user's model is left as it was."""

from __future__ import annotations


import pytest
import torch
import torch.distributed as dist
from torch import nn

import autopar
from autopar import _compat
from models.gpt import GPT, GPTConfig
from tests._util import fake_world


def _gpt(**kw):
    torch.manual_seed(0)
    return GPT(GPTConfig(**{**GPTConfig.tiny().__dict__, **kw}))


def _ids(b=4, t=16):
    x = torch.randint(0, 64, (b, t))
    return x, x.clone()


def _state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_mesh_size_must_match_world_size():
    model = _gpt()
    with fake_world(4):
        with pytest.raises(autopar.MeshError, match=r"world size 4.*multiply to 4"):
            autopar.parallelize(model, autopar.Mesh({"tp": 2}), _ids())


def test_parallelize_without_a_process_group_says_how_to_launch():
    if dist.is_initialized():
        dist.destroy_process_group()
    with pytest.raises(autopar.MeshError, match="torchrun --nproc-per-node 2"):
        autopar.parallelize(_gpt(), autopar.Mesh({"tp": 2}), _ids())


def test_a_dim_that_does_not_divide_its_axis_when_forced():
    model = _gpt(n_head=3, n_embd=24)  # 3 heads cannot split over tp=2
    before = _state(model)
    with pytest.raises(autopar.ShardingError, match=r"attn:scaled_dot_product_attention.*dim 1 \(size 3\).*tp=2"):
        autopar.plan(model, autopar.Mesh({"tp": 2}), _ids(), constraints=[("h.0.attn:scaled_dot_product_attention", "S(1)")])
    assert _same(before, _state(model))
    # unforced, the solver simply does not split the heads
    plan = autopar.plan(model, autopar.Mesh({"tp": 2}), _ids())
    assert "S(1)" not in str(plan.nodes["scaled_dot_product_attention"].strategy.output)


def test_batch_that_does_not_divide_the_data_axes():
    with pytest.raises(autopar.ShardingError, match=r"batch dim 6.*dp=4.*multiple of 4"):
        autopar.plan(_gpt(), autopar.Mesh({"dp": 4}), _ids(b=6))


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = Gate()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        return self.proj(self.gate(x)).sum()


class Gate(nn.Module):
    def forward(self, x):
        if x.sum() > 0:  # control flow on a tensor's value
            return x * 2
        return x


def test_untraceable_model_names_the_module_and_the_fix():
    model = DataDependent()
    before = _state(model)
    with pytest.raises(autopar.TraceError) as e:
        autopar.plan(model, autopar.Mesh({"tp": 2}), (torch.randn(4, 8),))
    msg = str(e.value)
    assert "'gate'" in msg and "Gate" in msg and "torch.cond" in msg
    assert _same(before, _state(model))


def test_a_budget_no_plan_fits_names_the_smallest_budget():
    model = _gpt()
    with pytest.raises(autopar.InfeasibleError) as e:
        autopar.plan(model, autopar.Mesh({"tp": 2}), _ids(), memory_budget=1000)
    assert e.value.smallest_budget and e.value.smallest_budget > 1000
    assert "at least" in str(e.value) and f"{e.value.smallest_budget:.0f} bytes" in str(e.value)
    # and that budget is enough
    plan = autopar.plan(model, autopar.Mesh({"tp": 2}), _ids(), memory_budget=e.value.smallest_budget)
    assert plan.cost.memory_per_device <= e.value.smallest_budget


def test_a_cluster_that_cannot_split_the_batch_says_so_and_one_too_small_names_its_smallest_budget():
    """A model without four repeated blocks is planned on each dp x tp mesh of the cluster: a global batch none of
    them splits is refused as that (it was "no plan fits 74.5 GiB", as if memory were why), and a budget none fits
    names the smallest one, in readable units."""
    model = _gpt()
    with pytest.raises(autopar.AutoparError, match=r"global batch of 7 rows.*multiple of 2") as e:
        autopar.plan(model, autopar.Cluster(2, 8, "a100-80gb"), _ids(b=7))
    assert "GiB" not in str(e.value) and not isinstance(e.value, autopar.InfeasibleError)
    with pytest.raises(autopar.InfeasibleError) as e:
        autopar.plan(model, autopar.Cluster(1, 8, "a100-80gb"), _ids(b=8), memory_budget=1000)
    need = e.value.smallest_budget
    assert need and need > 1000 and "1000 B per device" in str(e.value) and f"({need:.0f} bytes)" in str(e.value)
    plan = autopar.plan(model, autopar.Cluster(1, 8, "a100-80gb"), _ids(b=8), memory_budget=need)
    assert plan.cost.memory_per_device <= need
    # with repeated blocks to screen: the smallest candidate the screen sized, and about what it needs
    with pytest.raises(autopar.InfeasibleError, match=r"1000 B per device.*the smallest, dp=\d+ .*needs about [\d.]+ KiB"):
        autopar.plan(_gpt(n_layer=4), autopar.Cluster(1, 8, "a100-80gb"), _ids(b=8), memory_budget=1000)


def test_a_budget_that_is_no_number_of_bytes_is_refused_before_planning():
    model = _gpt()
    for bad in (0, -1.0, "40GB", True):
        for call in (lambda: autopar.plan(model, autopar.Mesh({"tp": 2}), _ids(), memory_budget=bad),
                     lambda: autopar.handwritten(model, autopar.Mesh({"tp": 2}), _ids(), "megatron", memory_budget=bad)):
            with pytest.raises(autopar.AutoparError, match=r"memory_budget=.*positive number"):
                call()


def test_parallelize_leaves_the_users_model_as_it_was_even_after_training():
    model = _gpt()
    before = _state(model)
    with fake_world(2), _compat.local_tensor_mode(2):
        pm = autopar.parallelize(model, autopar.Mesh({"tp": 2}), _ids())
        opt = torch.optim.SGD(pm.parameters(), lr=0.1)
        pm(*pm.local_inputs(*_ids())).backward()
        opt.step()
    assert _same(before, _state(model))


def test_a_plan_for_another_model_or_mesh_is_refused():
    plan = autopar.plan(_gpt(), autopar.Mesh({"tp": 2}), _ids())
    with fake_world(2):
        with pytest.raises(autopar.PlanMismatchError, match=r"different graph .*\(the model differs"):
            autopar.parallelize(_gpt(n_layer=3), autopar.Mesh({"tp": 2}), _ids(), plan=plan)
        short = _ids(t=4)  # the same model on other shapes: says which
        with pytest.raises(autopar.PlanMismatchError, match=r"its inputs had shapes \[\(4, 16\), \(4, 16\)\], these have \[\(4, 4\), \(4, 4\)\]"):
            autopar.parallelize(_gpt(), autopar.Mesh({"tp": 2}), short, plan=plan)
        with pytest.raises(autopar.PlanMismatchError, match="mesh"):
            autopar.parallelize(_gpt(), autopar.Mesh({"dp": 2}), _ids(), plan=plan)
        # a plan's JSON text where the Plan goes; a file name where its text goes; a ParallelModule planned again
        with pytest.raises(autopar.AutoparError, match=r"plan= takes an autopar.Plan; got a str: .*Plan.from_json\(open\(path\).read\(\)\)"):
            autopar.parallelize(_gpt(), autopar.Mesh({"tp": 2}), _ids(), plan=plan.to_json())
        with pytest.raises(autopar.AutoparError, match=r"'plan.json' looks like a file name: pass its text, open\('plan.json'\).read\(\)"):
            autopar.Plan.from_json("plan.json")
        # a pickle's or torch.save's bytes, or JSON nested past the parser's depth: refused, never unpickled (a
        # UnicodeDecodeError and a RecursionError)
        import io
        import pickle

        saved = io.BytesIO()
        torch.save({"w": torch.zeros(2)}, saved)
        for data in (pickle.dumps({"format": "autopar.plan"}), saved.getvalue()):
            with pytest.raises(autopar.AutoparError, match=r"not a plan: binary data, not JSON text"):
                autopar.Plan.from_json(data)
        with pytest.raises(autopar.AutoparError, match="nested too deeply"):
            autopar.Plan.from_json("[" * 100_000)
        assert autopar.Plan.from_json(plan.to_json().encode()).graph_hash == plan.graph_hash  # (UTF-8 bytes of one: fine)
        with _compat.local_tensor_mode(2):
            pm = autopar.parallelize(_gpt(), autopar.Mesh({"tp": 2}), _ids(), plan=plan)
            for again in (autopar.plan, autopar.parallelize):
                with pytest.raises(autopar.AutoparError, match="already parallelized .*full_state_dict"):
                    again(pm, autopar.Mesh({"tp": 2}), _ids())
        # a plan made with a block frozen gives its weights no gradient reduction: unfrozen since, they would train
        # apart on each rank (replicas 0.05 apart after 3 steps)
        frozen = _gpt()
        frozen.h[0].requires_grad_(False)
        without = autopar.Plan.from_json(autopar.plan(frozen, autopar.Mesh({"tp": 2}), _ids()).to_json())
        with pytest.raises(autopar.PlanMismatchError, match=r"different graph .*which parameters require grad"):
            autopar.parallelize(_gpt(), autopar.Mesh({"tp": 2}), _ids(), plan=without)
        # the same axes and preset name, other numbers (a recalibrated preset, a changed field): says which
        import dataclasses

        from autopar.hardware import get_hardware

        fused = autopar.plan(_gpt(), autopar.Mesh({"tp": 2}, hardware=dataclasses.replace(get_hardware("cpu-gloo"), optimizer_kernel="fused")), _ids())
        with pytest.raises(autopar.PlanMismatchError, match=r"the hardware 'cpu-gloo' differs in optimizer_kernel"):
            autopar.parallelize(_gpt(), autopar.Mesh({"tp": 2}), _ids(), plan=fused)
    # the hash names the parameters the user froze only: a model whose parameters all require grad keeps the hash
    # its plans were saved with, even where one is planned frozen (unused, or read under no_grad)
    from autopar.trace import _graph_hash, trace

    class Unused(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.spare = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

        def forward(self, x):
            return self.lin(x).sum()

    tg = trace(Unused(), (torch.randn(4, 8),))
    assert tg.trainable != {n for n, k in tg.kinds.items() if k == "param"} and tg.hash == _graph_hash(tg.gm)


class _Masked(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, x, y):
        return self.lin(x)[y > 0].sum()  # a shape only the data decides


class _Item(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, x, y):
        return self.lin(x).sum() / (y > 0).sum().item()  # a number only the data decides


class _KeywordOnly(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 4)

    def forward(self, x, *, labels):
        return torch.nn.functional.cross_entropy(self.lin(x), labels)


class _Branchy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)

    def forward(s, x):  # noqa: N805  (a method whose first argument is not called self)
        h = s.lin(x)
        if h.sum() > 0:  # control flow on a value
            return h.sum()
        return -h.sum()


def test_an_untraceable_forward_is_located_and_hooks_are_named():
    """The trace error points at the model's own line, whatever its forward calls its first argument (with
    ``def forward(s, x)`` it pointed into torch's nn.Module); hooks, which run while the model is traced and never on
    the program's steps, are named in a warning."""
    import os

    with fake_world(2), pytest.raises(autopar.TraceError, match=rf"in module '<root>' \(_Branchy\) at {os.path.abspath(__file__)}:\d+"):
        autopar.parallelize(_Branchy(), autopar.Mesh({"dp": 2}), torch.randn(4, 16))
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 1))
    seen = []
    model[0].register_forward_hook(lambda mod, inp, out: seen.append(out))
    model[1].weight.register_hook(lambda g: g)
    with fake_world(2), _compat.local_tensor_mode(2):
        with pytest.warns(UserWarning, match=r"2 hook\(s\) \(forward hook on 0, gradient hook on 1.weight\).*run on its steps"):
            pm = autopar.parallelize(model, autopar.Mesh({"dp": 2}), torch.randn(4, 16))
        traced = len(seen)
        pm(*pm.local_inputs(torch.randn(4, 16)))
    assert len(seen) == traced  # (hence the warning)
    # torch's own hooks (weight_norm's forward pre-hook recomputes the weight: traced into the program) are not the
    # user's: no warning
    import warnings

    normed = torch.nn.Sequential(torch.nn.Linear(16, 1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        torch.nn.utils.weight_norm(normed[0])
    assert _compat.hooks_of(normed) == []


def test_a_data_dependent_shape_and_keyword_inputs_are_explained():
    """Boolean-mask indexing traces (to a shape of unknown size) but cannot be planned: the error names the node,
    the line and the fix (it was torch's GuardOnDataDependentSymNode from the strategy layer); example_inputs that
    do not fit the forward's signature say that they are its positional arguments (it was export's "missing a
    required argument")."""
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    with pytest.raises(autopar.TraceError, match=r"shape depends on the values.*node index.*return self.lin\(x\)\[y > 0\].*masked sum"):
        autopar.plan(_Masked(), autopar.Mesh({"dp": 2}), (x, y))
    with pytest.raises(autopar.TraceError, match=r"into a Python number: node item .*\(y > 0\).sum\(\).item\(\).*keep it a tensor"):
        autopar.plan(_Item(), autopar.Mesh({"dp": 2}), (x, y))  # (it named neither module nor line)
    labels = torch.zeros(8, dtype=torch.long)
    for inputs in ((x, labels), ((x,), {"labels": labels})):
        with pytest.raises(autopar.TraceError, match=r"do not fit _KeywordOnly.forward\(x, \*, labels\).*positional arguments"):
            autopar.plan(_KeywordOnly(), autopar.Mesh({"dp": 2}), inputs)


class _Renormed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(64, 16, max_norm=1.0)
        self.head = torch.nn.Linear(16, 64)

    def forward(self, ids, targets):
        return torch.nn.functional.cross_entropy(self.head(self.emb(ids)).flatten(0, 1), targets.flatten())


class _DroppedBranch(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.drop = torch.nn.Linear(16, 16), torch.nn.Dropout(0.1)

    def forward(self, x):
        h = self.drop(self.lin(x))
        if h.sum() > 0:  # control flow on a value, after a random op
            h = h * 2
        return h.sum()


class _Writes(torch.nn.Module):
    """Writes in place to a copy of its weight (``contiguous`` of a transpose copies), or to a view of it."""

    def __init__(self, view: bool):
        super().__init__()
        self.w, self.view = torch.nn.Parameter(torch.randn(16, 16)), view

    def forward(self, x):
        if self.view:
            with torch.no_grad():
                self.w.t().clamp_(-1, 1)  # the weight itself, through a view
            w = self.w
        else:
            w = self.w.t().contiguous()
            w.mul_(2.0)  # a copy: the weight is left as it is
        return (x @ w).sum()


def test_a_parameter_changed_in_place_by_forward_is_refused_and_a_value_branch_is_named():
    """nn.Embedding(max_norm=...) renormalises its weight's rows in place as forward reads them: on tp it trained to
    other numbers (loss 4.216 against 4.158) and on dp it failed inside the gradient sync ("a view ... modified
    inplace"), naming nothing. It is refused at the trace, naming the parameter, the module and the fix. A branch on a
    value that torch's shape guard fails on with a message of its own ("unsupported operand type(s) for -:
    'Equality' and 'Equality'") gets the control-flow hint as the others do."""
    ids = torch.randint(0, 64, (4, 8))
    with pytest.raises(autopar.TraceError, match=r"changes parameter 'emb.weight' in place: node embedding_renorm_ .*in module 'emb'.*drop max_norm"):
        autopar.plan(_Renormed(), autopar.Mesh({"dp": 2}), (ids, ids))
    x = torch.randn(4, 16)
    with pytest.raises(autopar.TraceError, match=r"changes parameter 'w' in place: node clamp_"):
        autopar.plan(_Writes(view=True), autopar.Mesh({"dp": 2}), (x,))
    autopar.plan(_Writes(view=False), autopar.Mesh({"dp": 2}), (x,))  # (a copy's write: planned as before)
    with pytest.raises(autopar.TraceError, match=r"_DroppedBranch.*\n.*control flow that depends on tensor values"):
        autopar.plan(_DroppedBranch(), autopar.Mesh({"dp": 2}), (torch.randn(4, 16),))


def test_a_weight_pinned_split_over_a_data_axis_points_to_zero():
    """Data axes split the batch and nothing else: a pin splitting a parameter over one says so, and what does what
    the user meant (ZeroPin, or a tensor-parallel axis)."""
    with pytest.raises(autopar.ShardingError, match=r"h.0.attn.c_attn.weight: pinned spec RS\(0\) splits a param over dp, a data axis.*ZeroPin"):
        autopar.plan(_gpt(), autopar.Mesh({"tp": 2, "dp": 2}), _ids(), constraints=[autopar.Pin("h.0.attn.c_attn.weight", "RS(0)")])


def test_wrong_input_shapes_are_explained():
    with fake_world(2), _compat.local_tensor_mode(2):
        pm = autopar.parallelize(_gpt(), autopar.Mesh({"dp": 2}), _ids())
        with pytest.raises(autopar.AutoparError, match="local_inputs"):
            pm(*_ids())  # the global batch, not this rank's share


def test_inputs_of_another_dtype_are_explained():
    """Floating inputs of another dtype than the weights fail on one device at the first matmul; export's fake
    kernels let them through, so planning succeeded and the first step raised torch's bare error. Now the trace
    names the op and its operands' dtypes, and a plan run on a batch of another dtype than planned says so."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    x = torch.randn(8, 16)
    with pytest.raises(autopar.TraceError, match=r"multiplies tensors of different dtypes \(input\S* torch.float64, "
                                                 r".*torch.float32.*in module '0'"):
        autopar.plan(model, autopar.Mesh({"dp": 2}), x.double())
    with fake_world(2), _compat.local_tensor_mode(2):
        pm = autopar.parallelize(model, autopar.Mesh({"dp": 2}), x)
        with pytest.raises(autopar.AutoparError, match=r"input 0 \(\S+\) has dtype torch.float64, but the plan is for torch.float32"):
            pm(*pm.local_inputs(x.double()))


def test_bad_mesh_and_hardware():
    with pytest.raises(autopar.MeshError, match="positive"):
        autopar.Mesh({"tp": 0})
    with pytest.raises(autopar.MeshError, match="known presets"):
        autopar.Mesh({"tp": 2}, hardware="tpu-v9")
    with pytest.raises(autopar.AutoparError, match="S\\(<dim>\\)"):
        autopar.Spec.parse("X(1)")
    import dataclasses

    from autopar.hardware import get_hardware
    with pytest.raises(autopar.MeshError, match="optimizer_kernel 'apex'.*fused=True"):
        dataclasses.replace(get_hardware("h100-80gb"), optimizer_kernel="apex")
    with pytest.raises(autopar.MeshError, match="optimizer_step_bytes names \\['foreach', 'fused'\\].*for-loop"):
        dataclasses.replace(get_hardware("h100-80gb"), optimizer_step_bytes=(("fused", 28.0), ("foreach", 80.0)))


def test_parallelize_refuses_hardware_that_prices_another_runtime():
    """A preset describing FSDP2 or torch.compile (overlap, fused_elementwise, ...) prices what autopar's runtime
    does not do: planning with it is allowed, running is refused with the fields named, and the model is untouched;
    ``autopar_runtime()`` gives the same hardware as autopar runs on it."""
    import dataclasses

    from autopar.hardware import FOREIGN_RUNTIME, get_hardware

    model = _gpt()
    before = _state(model)
    hw = dataclasses.replace(get_hardware("cpu-gloo"), overlap=1.0, fused_elementwise=True)
    assert hw.foreign_runtime() == {"overlap": 1.0, "fused_elementwise": True}
    with fake_world(2):
        with pytest.raises(autopar.NotRealised, match=r"overlap=1.0, fused_elementwise=True.*autopar_runtime\(\)"):
            autopar.parallelize(model, autopar.Mesh({"dp": 2}, hardware=hw), _ids())
    assert _same(before, _state(model))
    plain = hw.autopar_runtime()
    assert plain.foreign_runtime() == {} and plain.peak_flops == hw.peak_flops and plain.name == hw.name
    assert all(getattr(plain, f) == getattr(get_hardware("cpu-gloo"), f) for f in FOREIGN_RUNTIME)


def test_an_autocast_region_in_forward_is_named_with_a_fix():
    """export keeps ``torch.autocast`` in forward as a higher-order op autopar cannot plan: the error says which
    construct, in which module, and what to do instead (it said "a non-tensor value NoneType")."""

    class Mixed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(8, 8)

        def forward(self, x):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                h = self.proj(x)
            return h.float().square().mean()

    with pytest.raises(autopar.TraceError, match=r"autocast.*mixed_precision=autopar.MixedPrecision\(torch.bfloat16"):
        autopar.plan(Mixed(), autopar.Mesh({"dp": 2}), (torch.randn(4, 8),))


def test_a_parameter_unfrozen_after_parallelize_is_refused():
    """The plan gives a parameter frozen when parallelized no gradient reduction (its gradients went unreduced and
    the replicas drifted apart); freezing after parallelize is fine."""
    model = _gpt()
    model.h[0].ln_1.weight.requires_grad_(False)
    x = _ids()
    with fake_world(2), _compat.local_tensor_mode(2):
        pm = autopar.parallelize(model, autopar.Mesh({"dp": 2}), x)
        pm.get_parameter("h.1.ln_1.weight").requires_grad_(False)
        pm(*pm.local_inputs(*x)).backward()
        pm.get_parameter("h.0.ln_1.weight").requires_grad_(True)
        with pytest.raises(autopar.AutoparError, match="h.0.ln_1.weight was frozen .* unfreeze it on the model before autopar.parallelize"):
            pm(*pm.local_inputs(*x))


def test_torch_compile_of_a_parallel_module_runs_it_as_it_is():
    """torch.compile(pmodel): its forward runs uncompiled (compiled, the collectives' backwards ran out of the order
    they wait in: gradients up to 3e38), so training equals the module called directly."""
    x = _ids()
    with fake_world(2), _compat.local_tensor_mode(2):
        pm = autopar.parallelize(_gpt(), autopar.Mesh({"dp": 2}), x)
        compiled = torch.compile(pm, backend="eager")
        compiled(*pm.local_inputs(*x)).backward()
        got = {n: p.grad.clone() for n, p in pm.named_parameters()}
        pm.zero_grad()
        pm(*pm.local_inputs(*x)).backward()
        for n, p in pm.named_parameters():
            assert torch.equal(p.grad, got[n]), n


def test_state_dict_is_refused_where_a_rank_holds_pieces():
    """torch.distributed.checkpoint of ``pmodel.state_dict()`` (torchtitan's idiom) took each rank's shards for whole
    tensors and kept one rank's (parameters 0.127 off after a load); a data-parallel plan's state dict is whole."""
    x = _ids()
    with fake_world(2), _compat.local_tensor_mode(2):
        for constraints, says in (([autopar.ZeroPin("*", 1)], "ZeRO keeps a flat shard of"),
                                  ([("h.*.mlp.c_fc.weight", "S(0)")], r"the plan splits \S+ as \S+")):
            model = _gpt()
            pm = autopar.parallelize(model, autopar.Mesh({"dp" if "ZeRO" in says else "tp": 2}), x, constraints=constraints)
            with pytest.raises(autopar.AutoparError, match=says + ".*Save pmodel.full_state_dict()"):
                pm.state_dict()
            with pytest.raises(autopar.AutoparError, match="use pmodel.load_full_state_dict"):
                pm.load_state_dict(model.state_dict())
            assert _same(pm.full_state_dict(), _state(model))
        pm = autopar.parallelize(model, autopar.Mesh({"dp": 2}), x, constraints=[autopar.ZeroPin("*", 0)])
        pm.load_state_dict(pm.state_dict())
        assert set(pm.state_dict()) <= set(model.state_dict())


def test_a_call_off_the_planned_inputs_says_what_was_planned():
    """A batch of another size (a loader's short last batch) and arguments structured otherwise: each error says
    what the plan is for and how to go on (the second printed two raw pytree specs)."""
    x = _ids()
    with fake_world(2), _compat.local_tensor_mode(2):
        pm = autopar.parallelize(_gpt(), autopar.Mesh({"dp": 2}), x)
        short = tuple(t[:2] for t in x)
        with pytest.raises(autopar.AutoparError, match=r"input 0 \(idx\) has shape \[1, 16\].*is \[2, 16\].*pad a short last batch"):
            pm(*pm.local_inputs(*short))
        with pytest.raises(autopar.AutoparError, match=r"planned for the inputs \(idx, targets\).*got 1 positional argument \(tuple\)"):
            pm(pm.local_inputs(*x))
