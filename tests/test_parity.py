"""Parity with single-device training, on simulated ranks (LocalTensorMode): loss, every gradient, and the
parameters after 3 AdamW steps, within 1e-5 in fp32, for the solver's plans and for textbook plans."""

from __future__ import annotations

import copy

import pytest
import torch

import autopar
from autopar import _compat
from models.gpt import GPT, GPTConfig
from models.llama import Llama, LlamaConfig
from tests._util import fake_world, hugging_face, parity

MESHES = [{"dp": 2}, {"tp": 2}, {"tp": 4}, {"dp": 2, "tp": 2}]


def _model(name):
    torch.manual_seed(0)
    if name == "gpt":
        return GPT(GPTConfig.tiny())
    return Llama(LlamaConfig.tiny())


def _inputs(batch=4, seq=16):
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 64, (batch, seq), generator=g)
    return x, torch.roll(x, -1, dims=1)


def megatron_pins(name: str, axes: dict, sequence_parallel: bool = False) -> list:
    """Column-parallel then row-parallel weights on the tp axis (R elsewhere); residual stream split by sequence."""
    def on_tp(p: str) -> str:
        return "".join(p if a == "tp" else "R" for a in axes)

    if name == "gpt":
        col = ["h.*.attn.c_attn.weight", "h.*.mlp.c_fc.weight"]
        row = ["h.*.attn.c_proj.weight", "h.*.mlp.c_proj.weight"]
        residual = "h.[0-9]:add*"
    else:
        col = ["layers.*.attention.w[qkv].weight", "layers.*.feed_forward.w[13].weight"]
        row = ["layers.*.attention.wo.weight", "layers.*.feed_forward.w2.weight"]
        residual = "layers.[0-9]:add*"
    pins = [(p, on_tp("S(0)")) for p in col] + [(p, on_tp("S(1)")) for p in row]
    if sequence_parallel:
        pins.append((residual, "".join("S(1)" if a == "tp" else "S(0)" for a in axes)))
    return pins


@pytest.mark.parametrize("axes", MESHES, ids=lambda a: "x".join(f"{k}{v}" for k, v in a.items()))
@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_solver_plan_matches_single_device(name, axes):
    r = parity(_model(name), _inputs(), axes)
    assert r["loss"] <= 1e-5 and r["grad"] <= 1e-5 and r["param"] <= 1e-5, r


@pytest.mark.parametrize("axes", [{"tp": 2}, {"tp": 4}, {"dp": 2, "tp": 2}], ids=lambda a: "x".join(f"{k}{v}" for k, v in a.items()))
@pytest.mark.parametrize("sp", [False, True], ids=["megatron", "megatron-sp"])
@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_textbook_plans_match_single_device(name, axes, sp):
    r = parity(_model(name), _inputs(), axes, constraints=megatron_pins(name, axes, sp))
    kinds = {(c.kind, c.phase) for c in r["plan"].collectives() if not c.where.startswith("grads")}
    if sp:  # sequence parallel: the partial sums are reduce-scattered, not all-reduced
        assert ("reduce_scatter", "forward") in kinds and ("all_gather", "forward") in kinds
    else:
        assert ("all_reduce", "forward") in kinds
    assert r["loss"] <= 1e-5 and r["grad"] <= 1e-5 and r["param"] <= 1e-5, r


@pytest.mark.parametrize("axes,spec", [({"cp": 4}, "S(2)"), ({"dp": 2, "cp": 2}, "S(0)S(2)"), ({"pp": 2, "cp": 2}, "RS(2)")],
                         ids=["cp4", "dp2xcp2", "pp2xcp2"])
def test_context_parallel_causal_attention_matches_single_device(axes, spec):
    """Every attention's queries split by sequence over cp, keys and values gathered whole (the all-gather form of
    context parallelism): the causal mask of each rank's queries is offset by their first row
    (``passes/causal_offsets.py``, on each pipeline stage's program too; without it the loss is off by 3e-3).
    Llama: grouped-query attention, RoPE."""
    r = parity(_model("llama"), _inputs(), axes, constraints=[("*:scaled_dot_product_attention*", spec)])
    plan = r["plan"]
    attention = [n for n in plan.nodes if "scaled_dot_product_attention" in n]
    assert attention and all(str(plan.nodes[n].strategy.output) == spec for n in attention)
    assert r["loss"] <= 1e-5 and r["grad"] <= 1e-5 and r["param"] <= 1e-5, r


def test_context_parallel_attention_with_an_explicit_mask_matches_single_device():
    """Hugging Face's Mistral hands attention a sliding-window mask it builds itself: split with the queries by
    their rows, the local op is the op (no offset needed)."""
    model = hugging_face("mistral", layers=2)
    x = _inputs()[0]
    r = parity(model, (x, x.clone()), {"dp": 2, "cp": 2}, constraints=[("*:scaled_dot_product_attention*", "S(0)S(2)")])
    plan = r["plan"]
    attention = [str(plan.nodes[n].strategy) for n in plan.nodes if "scaled_dot_product_attention" in n]
    assert attention and all(s == "(S(0)S(2), S(0)R, S(0)R, S(0)S(2)) -> S(0)S(2)" for s in attention), attention
    assert r["loss"] <= 1e-5 and r["grad"] <= 1e-5 and r["param"] <= 1e-5, r


@pytest.mark.parametrize("axes", [{"dp": 2, "cp": 2}, {"cp": 4}, {"dp": 2, "cp": 2, "tp": 2}], ids=["dp2xcp2", "cp4", "dp2xcp2xtp2"])
def test_fsdp_with_context_parallelism_matches_single_device(axes):
    """torchtitan's FSDP + CP (and FSDP + TP + CP), written by hand: every attention's queries split by sequence on
    cp (balanced; on tp, its heads), and ZeRO-3 sharding each parameter over the data and cp axes both (a cp rank
    runs other tokens of the same sequences, so a weight's gradient sums over cp as over dp)."""
    model, inputs = _model("llama"), _inputs()
    plan = autopar.handwritten(model, autopar.Mesh(axes, hardware="cpu-gloo"), inputs, "fsdp")
    assert plan.label == ("fsdp+tp+cp(sp)" if "tp" in axes else "fsdp+cp")
    shard = tuple(a for a in axes if a != "tp")
    assert {(stage, tuple(on)) for stage, on in plan.zero_stages.values()} == {(3, shard)}
    if "tp" in axes:
        attention = {str(plan.nodes[n].strategy.output) for n in plan.nodes if "scaled_dot_product_attention" in n}
        assert attention == {"S(0)S(2)S(1)"}
    sends = {c.axis for c in plan.collective_list if c.kind == "send"}
    assert sends == {"cp"}  # the balanced attention's swaps
    r = parity(model, inputs, axes, plan=plan)
    assert r["loss"] <= 1e-5 and r["grad"] <= 1e-5 and r["param"] <= 1e-5, r


def test_ulysses_style_attention_on_heads_between_sequence_split_layers_matches_single_device():
    """The other context-parallel form: the residual stream split by sequence, attention by heads, the weights
    whole; the redistribution between them is an all-to-all (sequence- to head-split and back)."""
    axes = {"cp": 2}
    pins = [("*:scaled_dot_product_attention*", "S(1)"), ("layers.[0-9]:add*", "S(1)"),
            ("layers.*.attention.w[qkvo].weight", "R"), ("layers.*.feed_forward.w[123].weight", "R")]
    r = parity(_model("llama"), _inputs(), axes, constraints=pins)
    assert ("all_to_all", "forward") in {(c.kind, c.phase) for c in r["plan"].collectives()}
    assert r["loss"] <= 1e-5 and r["grad"] <= 1e-5 and r["param"] <= 1e-5, r


@pytest.mark.parametrize("axes,pins", [({"dp": 2, "tp": 2}, "megatron+zero3"), ({"pp": 2, "dp": 2}, "pipeline")])
def test_clip_grad_norm_is_the_single_device_norm_of_every_order(axes, pins):
    """``clip_grad_norm_`` over tensor-parallel shards, ZeRO-3 flat shards (zero-padded) and data-parallel replicas,
    or pipeline stages with the embedding tied across them: each order's norm is the one-device model's on every
    rank, the clipped gradients are its clipped gradients, and a non-finite norm is refused when asked."""
    import math

    model, inputs = _model("gpt"), _inputs()
    constraints = (megatron_pins("gpt", axes) + [autopar.ZeroPin("*", 3)] if pins == "megatron+zero3"
                   else [autopar.PipelinePin("1f1b", 2)])
    reference = copy.deepcopy(model)
    reference(*inputs).backward()
    world = math.prod(axes.values())
    with fake_world(world), _compat.local_tensor_mode(world) as ltm:
        pm = autopar.parallelize(model, autopar.Mesh(axes), inputs, constraints=constraints)
        pm(*pm.local_inputs(*inputs)).backward()
        for p in (1.0, 3.0, float("inf")):
            norm = pm.clip_grad_norm_(1e9, norm_type=p)  # nothing clipped: the norm alone
            with ltm.disable():
                want = float(torch.nn.utils.get_total_norm([q.grad for q in reference.parameters()], p))
            assert all(float(v) == pytest.approx(want, rel=1e-5) for v in _compat.local_values(norm).values()), (p, want)
        pm.clip_grad_norm_(0.1)
        grads = pm.full_grads()
        with ltm.disable():
            torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.1)
            assert max(float((grads[k] - q.grad).abs().max()) for k, q in reference.named_parameters()) < 1e-6
        next(pm.parameters()).grad[0] = float("nan")
        with pytest.raises(autopar.AutoparError, match="non-finite"):
            pm.clip_grad_norm_(1.0, error_if_nonfinite=True)


class Distill(torch.nn.Module):
    """A student trained against a teacher run under ``torch.no_grad()`` in the same forward (distillation, EMA
    targets): export wraps the block in a higher-order op."""

    def __init__(self):
        super().__init__()
        self.student = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))
        self.teacher = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))

    def forward(self, x, y):
        with torch.no_grad():
            target = self.teacher(x).softmax(-1)
        out = self.student(x)
        return torch.nn.functional.mse_loss(out.softmax(-1), target) + torch.nn.functional.mse_loss(out, y)


@pytest.mark.parametrize("axes,zero", [({"dp": 2}, 3), ({"dp": 2, "tp": 2}, None)])
def test_a_no_grad_block_in_forward_is_inlined_and_takes_no_gradient(axes, zero):
    """The ``torch.no_grad()`` block is inlined into the planned program with its inputs detached: the teacher's
    parameters take no gradient (planned as frozen: no reduction, no optimizer state), the student trains as on one
    device."""
    from autopar.trace import trace

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    inputs = (torch.randn(8, 32, generator=g), torch.randn(8, 32, generator=g))
    tg = trace(Distill(), inputs)
    assert not any("higher_order" in str(n.target) for n in tg.gm.graph.nodes)
    assert {tg.fqns[n] for n in tg.trainable} == {k for k, _ in Distill().named_parameters() if k.startswith("student.")}
    torch.manual_seed(0)
    r = parity(Distill(), inputs, axes, constraints=[autopar.ZeroPin("*", zero)] if zero else [])
    assert r["loss"] <= 1e-5 and r["grad"] <= 1e-5 and r["param"] <= 1e-5, r
    plan = r["plan"]
    assert not any("teacher" in plan.nodes[n].path for b in plan.grad_buckets for n in b.params)  # no gradient to sum
    if zero:  # the teacher is sharded with the rest, and only the student's gradients are reduce-scattered
        student = sum(p.numel() * 4 for k, p in Distill().named_parameters() if k.startswith("student."))
        assert any("teacher" in plan.nodes[n].path for b in plan.zero_buckets for n in b.params)
        assert sum(c.bytes for c in plan.collectives() if c.kind == "reduce_scatter") == student


def test_a_full_checkpoint_resumes_under_another_plan(tmp_path):
    """``full_state_dict()`` saved (torch.save, read back with weights_only) after a step under dp 2 x tp 2 with
    ZeRO-1 loads into a ParallelModule of a differently initialised model planned with ZeRO-3: every shard is
    the checkpoint's, so both give the same loss, and the second model itself is left as it was. A checkpoint
    that does not match says what is missing, unexpected or misshapen."""
    axes = {"dp": 2, "tp": 2}
    inputs = _inputs()
    with fake_world(4), _compat.local_tensor_mode(4) as ltm:
        first = autopar.parallelize(_model("gpt"), autopar.Mesh(axes), inputs, constraints=megatron_pins("gpt", axes) + [autopar.ZeroPin("*", 1)])
        opt = torch.optim.AdamW(first.parameters(), lr=1e-3)
        local = first.local_inputs(*inputs)
        first(*local).backward()
        opt.step()
        opt.zero_grad()
        state, ostate = first.full_state_dict(), first.full_optimizer_state_dict(opt)
        assert set(ostate["state"]) == {k for k, _ in _model("gpt").named_parameters()}
        # ZeRO's flat shards are 1-D; the shapes to group an optimizer's parameters by are one device's
        assert all(p.dim() == 1 for p in first.parameters())
        assert first.full_shapes() == {k: p.shape for k, p in _model("gpt").named_parameters()}
        assert ostate["param_groups"][0]["lr"] == 1e-3

        def plain(v):  # (simulated ranks agree, checked by the gather: rank 0's values are the checkpoint)
            return _compat.local_values(v)[0] if isinstance(v, torch.Tensor) else v

        with ltm.disable():
            torch.save({k: plain(v) for k, v in state.items()}, tmp_path / "ckpt.pt")
            torch.save({"state": {k: {key: plain(v) for key, v in e.items()} for k, e in ostate["state"].items()},
                        "param_groups": ostate["param_groups"]}, tmp_path / "optim.pt")
            state = torch.load(tmp_path / "ckpt.pt", weights_only=True)
            ostate = torch.load(tmp_path / "optim.pt", weights_only=True)
            torch.manual_seed(5)
            other = GPT(GPTConfig.tiny())
            untouched = copy.deepcopy(other.state_dict())
        second = autopar.parallelize(other, autopar.Mesh(axes), inputs, constraints=[autopar.ZeroPin("*", 3)])
        assert _compat.local_values(second(*local)) != _compat.local_values(first(*local))
        second.load_full_state_dict(state)
        loaded = second.full_state_dict()
        same = [_compat.local_values(m(*local)) for m in (first, second)]
        with ltm.disable():
            assert set(loaded) == set(state) and all(torch.equal(loaded[k], state[k]) for k in state)
            assert all(torch.equal(v, other.state_dict()[k]) for k, v in untouched.items())
        assert all(float(same[0][r]) == pytest.approx(float(same[1][r]), abs=1e-6) for r in same[0])
        # with the optimizer's state (AdamW's moments, sharded as each plan shards the parameters, and its step)
        # the next step is the same step: training resumes where it stopped
        opt2 = torch.optim.AdamW(second.parameters(), lr=1e-4)
        second.load_full_optimizer_state_dict(opt2, ostate)
        assert opt2.param_groups[0]["lr"] == 1e-3
        for m, o in ((first, opt), (second, opt2)):
            m(*local).backward()
            o.step()
        a, b = first.full_state_dict(), second.full_state_dict()
        with ltm.disable():
            # (the plans sum in different orders, and AdamW's step on a near-zero gradient turns those last-bit
            # differences into ~1e-6; without the loaded moments the step differs by ~lr)
            assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-5
        with pytest.raises(autopar.AutoparError, match=r"missing \['h.0.attn.c_attn.weight'\]"):
            second.load_full_state_dict({k: v for k, v in state.items() if k != "h.0.attn.c_attn.weight"})
        with pytest.raises(autopar.AutoparError, match="unexpected"):
            second.load_full_state_dict(state | {"h.9.mlp.c_fc.weight": state["h.0.mlp.c_fc.weight"]})
        with pytest.raises(autopar.AutoparError, match="h.0.mlp.c_fc.weight has shape"):
            second.load_full_state_dict(state | {"h.0.mlp.c_fc.weight": state["h.0.mlp.c_fc.weight"][:, :8]})
        # every entry is checked before any is copied: a refused state dict leaves the shards as they were (the
        # entries before a bad one were loaded)
        last, kept = list(state)[-1], second.full_state_dict()
        with ltm.disable():
            shifted = {k: v + 1 if v.is_floating_point() else v for k, v in state.items()}
        with ltm.disable():  # (a meta entry failed only while it was copied: after every entry before it was)
            meta = torch.empty(state[last].shape, device="meta")
        for bad, why in ((shifted | {last: shifted[last][:1]}, f"{last} has shape .* nothing was loaded"),
                         (shifted | {last: shifted[last].tolist()}, f"{last} is a list, not a tensor"),
                         (shifted | {last: meta}, f"{last} is on the meta device .*nothing was loaded")):
            with pytest.raises(autopar.AutoparError, match=why):
                second.load_full_state_dict(bad)
            now = second.full_state_dict()
            with ltm.disable():
                assert all(torch.equal(now[k], kept[k]) for k in kept)
        # a wrapper's keys (DDP's "module.") say so, strict or not; strict=False reports what it did not match
        with pytest.raises(autopar.AutoparError, match=r"none of its keys .*starts with 'module\.'"):
            second.load_full_state_dict({f"module.{k}": v for k, v in state.items()}, strict=False)
        # the optimizer's state likewise: checked whole before its groups or any entry are loaded
        bad = {"state": {k: dict(e) for k, e in ostate["state"].items()}, "param_groups": [dict(g, lr=7.0) for g in ostate["param_groups"]]}
        last_p = list(bad["state"])[-1]
        bad["state"][last_p]["exp_avg"] = bad["state"][last_p]["exp_avg"][:1]
        before = {id(p): {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in st.items()} for p, st in opt2.state.items()}
        with pytest.raises(autopar.AutoparError, match=rf"{last_p}'s exp_avg has shape .*nothing was loaded"):
            second.load_full_optimizer_state_dict(opt2, bad)
        assert opt2.param_groups[0]["lr"] != 7.0
        assert all(all(v is before[id(p)][k] or torch.equal(v, before[id(p)][k]) for k, v in st.items()) for p, st in opt2.state.items())
        # a path, or a dict that is no state dict, is refused with what to pass (a path's characters were read as
        # keys; a group's hyperparameter of another kind was taken: lr "oops")
        with pytest.raises(autopar.AutoparError, match=r"got str 'ckpt.pt', not a state dict; load the file first: torch.load"):
            second.load_full_state_dict("ckpt.pt")
        with pytest.raises(autopar.AutoparError, match=r"got a list, not a dict .*full_optimizer_state_dict\(optimizer\)"):
            second.load_full_optimizer_state_dict(opt2, [ostate])
        oops = dict(ostate, param_groups=[dict(g, lr="oops") for g in ostate["param_groups"]])
        with pytest.raises(autopar.AutoparError, match=r"group 0's lr is 'oops' \(str\).*nothing was loaded"):
            second.load_full_optimizer_state_dict(opt2, oops)
        assert opt2.param_groups[0]["lr"] != "oops"
        keys = second.load_full_state_dict({k: v for k, v in state.items() if k != "ln_f.weight"} | {"extra": state[last]}, strict=False)
        assert keys.missing_keys == ["ln_f.weight"] and keys.unexpected_keys == ["extra"]


class NormDrop(torch.nn.Module):
    """A BatchNorm (statistics over the batch, running statistics updated in training) and dropout."""

    def __init__(self):
        super().__init__()
        self.up, self.norm, self.drop, self.down = (torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32),
                                                    torch.nn.Dropout(0.3), torch.nn.Linear(32, 16))

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.down(self.drop(self.norm(self.up(x)))), y)


class InstanceRReLU(torch.nn.Module):
    """An InstanceNorm keeping running statistics (per-sample statistics in training, the running ones in eval) and
    an RReLU (a random slope per element in training, their mean in eval)."""

    def __init__(self):
        super().__init__()
        self.up, self.norm, self.act, self.down = (torch.nn.Linear(16, 32), torch.nn.InstanceNorm1d(4, track_running_stats=True, affine=True),
                                                   torch.nn.RReLU(), torch.nn.Linear(32, 16))

    def forward(self, x, y):
        h = self.norm(self.up(x).view(x.shape[0], 4, 8)).view(x.shape[0], 32)
        return torch.nn.functional.mse_loss(self.down(self.act(h)), y)


@pytest.mark.parametrize("name,axes", [("normdrop", {"dp": 2}), ("instance-rrelu", {"dp": 2}), ("gpt", {"dp": 2, "tp": 2})])
def test_eval_mode_turns_off_dropout_and_reads_batchnorms_running_statistics(name, axes):
    """A program traced in training mode follows ``pmodel.eval()`` as the module would: its validation loss is the
    single-device model's in eval mode (no dropout masks, attention's included; BatchNorm normalised by its
    running statistics), the running statistics and ``num_batches_tracked`` stay as they were, and
    ``pmodel.train()`` draws masks again (and moves the statistics, which a second ``eval()`` then reads, as the
    module's would). Before, eval() changed nothing: dropout stayed on and validation batches were folded into
    the running statistics."""
    import warnings
    from dataclasses import replace

    torch.manual_seed(0)
    if name == "gpt":
        model = GPT(replace(GPTConfig.tiny(), dropout=0.3))
        inputs = _inputs()
    else:
        model = NormDrop() if name == "normdrop" else InstanceRReLU()
        g = torch.Generator().manual_seed(1)
        inputs = (torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g))
    reference = copy.deepcopy(model)
    n = 1
    for v in axes.values():
        n *= v
    with fake_world(n), _compat.local_tensor_mode(n) as ltm, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (dropout: masks per shard)
        pm = autopar.parallelize(model, autopar.Mesh(axes), inputs, constraints=megatron_pins(name, axes) if name == "gpt" else [])
        local = pm.local_inputs(*inputs)
        pm(*local).backward()  # a training step: BatchNorm's running statistics move
        before = {k: v.clone() for k, v in pm.full_state_dict().items()}
        with ltm.disable():
            reference(*inputs).backward()
        pm.eval()
        assert not pm.training
        with torch.no_grad():
            shares = [_compat.local_values(pm(*local)) for _ in range(2)]
        after = pm.full_state_dict()
        pm.train()
        with torch.no_grad():
            trained = [_compat.local_values(pm(*local)) for _ in range(2)]
        pm.eval()  # and back again
        with torch.no_grad():
            again = _compat.local_values(pm(*local))
        with ltm.disable():
            reference.eval()
            with torch.no_grad():
                want = float(reference(*inputs))
            assert all(torch.equal(before[k], after[k]) for k in before), "eval mode changed a buffer"
            if name != "gpt":
                assert float((after["norm.running_mean"] - reference.norm.running_mean).abs().max()) < 1e-6
                assert int(after["norm.num_batches_tracked"]) == int(reference.norm.num_batches_tracked) == (name == "normdrop")
            with torch.no_grad():
                reference.train()  # the two training-mode calls move BatchNorm's statistics on both sides
                for _ in range(2):
                    reference(*inputs)
                reference.eval()
                want_again = float(reference(*inputs))
    for values in shares:  # every rank's share of the batch: their mean is the batch's
        assert abs(sum(float(v) for v in values.values()) / n - want) < 1e-5, (values, want)
    assert abs(sum(float(v) for v in again.values()) / n - want_again) < 1e-5, (again, want_again)
    means = [sum(float(v) for v in t.values()) / n for t in trained]  # masks again: a new one each call
    assert means[0] != means[1] and all(abs(m - want) > 1e-6 for m in means), (means, want)


class _Ema(torch.nn.Module):
    """A forward of its own that differs in training mode: it moves an average of its features (``if
    self.training``), which no op autopar switches expresses."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)
        self.register_buffer("average", torch.zeros(16))

    def forward(self, x, y):
        h = self.lin(x)
        if self.training:
            self.average.mul_(0.9).add_(h.detach().mean(0), alpha=0.1)
        return torch.nn.functional.mse_loss(h, y)


def test_a_mode_the_traced_program_cannot_act_is_refused():
    """A program is the model traced in the mode it was in. Traced in eval mode, a model whose forward differs in
    training (BatchNorm's batch statistics and running updates, dropout's masks) cannot train: ``pm.train()`` says
    so (before, the flag changed and the eval program trained, silently); one whose forward is the same in both
    modes switches freely. Traced in training mode, a branch of the model's own on ``self.training`` cannot be
    switched off: ``pm.eval()`` says so."""
    g = torch.Generator().manual_seed(1)
    inputs = (torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g))
    with fake_world(2), _compat.local_tensor_mode(2):
        pm = autopar.parallelize(NormDrop().eval(), autopar.Mesh({"dp": 2}), inputs)
        with pytest.raises(autopar.AutoparError, match=r"traced from a model in eval mode.*first at add_ in norm's forward.*model.train\(\)"):
            pm.train()
        assert not pm.training
        # (its forward's argument is called ``input``, a name torch.fx renames when it copies a graph: the plan
        # names the copy's)
        plain = autopar.parallelize(torch.nn.Sequential(torch.nn.Linear(16, 16)).eval(), autopar.Mesh({"dp": 2}), inputs[:1])
        assert plain.train().training and not plain.eval().training
        ema = autopar.parallelize(_Ema(), autopar.Mesh({"dp": 2}), inputs)
        with pytest.raises(autopar.AutoparError, match=r"first at mul_ in the model's forward.*cannot evaluate"):
            ema.eval()
        assert ema.training
        assert autopar.parallelize(NormDrop(), autopar.Mesh({"dp": 2}), inputs).eval().training is False


class _WeightNormed(torch.nn.Module):
    def __init__(self, spectral: bool):
        super().__init__()
        self.fc = torch.nn.utils.parametrizations.weight_norm(torch.nn.Linear(16, 16))
        # spectral_norm's power-iteration vectors are buffers, updated in place by each training forward
        self.out = (torch.nn.utils.parametrizations.spectral_norm if spectral else torch.nn.utils.parametrizations.weight_norm)(torch.nn.Linear(16, 16))

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.out(torch.tanh(self.fc(x))), y)


@pytest.mark.parametrize("mp", [False, True], ids=["fp32", "fp32-in-fp64"])
def test_parametrized_modules_train_as_on_one_device(mp):
    """weight_norm / spectral_norm (``torch.nn.utils.parametrize``) modules refuse copy.copy, which the trace's
    shallow copies used: parallelize failed with torch's "Serialization of parametrized modules is only supported
    through state_dict()". Their parametrizations are traced as ops; the user's model keeps its own. (Under mixed
    precision spectral_norm's fp64 buffers meet its fp32 compute weight, as under FSDP2's policy, which casts
    parameters alone: weight_norm only there.)"""
    torch.manual_seed(0)
    dtype = torch.float64 if mp else torch.float32
    model = _WeightNormed(spectral=not mp).to(dtype)
    g = torch.Generator().manual_seed(1)
    inputs = (torch.randn(8, 16, generator=g, dtype=dtype), torch.randn(8, 16, generator=g, dtype=dtype))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    r = parity(model, inputs, {"dp": 2}, mixed_precision=autopar.MixedPrecision(torch.float32, torch.float64) if mp else None)
    assert r["loss"] <= 1e-5 and r["grad"] <= 1e-5 and r["param"] <= 1e-5, r
    assert model.state_dict().keys() == before.keys()
    assert torch.nn.utils.parametrize.is_parametrized(model.fc, "weight")


def test_data_parallel_splits_the_batch_and_returns_share_means():
    r = parity(_model("gpt"), _inputs(batch=8), {"dp": 4}, hardware="h100-80gb")
    plan = r["plan"]
    assert str(plan.input_spec) == "S(0)"
    assert r["loss"] <= 1e-5 and r["grad"] <= 1e-5 and r["param"] <= 1e-5, r


@pytest.mark.parametrize("pins", [False, True], ids=["solver", "megatron-sp"])
def test_a_norm_computed_from_its_parts_matches_single_device(pins):
    """torchtitan's (and Hugging Face's) RMSNorm: cast, square, mean over the hidden dim, rsqrt, multiply, cast back
    (``type_as``, traced as a cast), times the weight -- on dp 2 x tp 2, the solver's plan and Megatron with the
    residual stream split by sequence, whose norms then reduce over a whole hidden dim on every rank."""
    from dataclasses import replace

    torch.manual_seed(0)
    model = Llama(replace(LlamaConfig.tiny(), norm="fp32-composite"))
    axes = {"dp": 2, "tp": 2}
    r = parity(model, _inputs(), axes, constraints=megatron_pins("llama", axes, True) if pins else ())
    assert r["loss"] <= 1e-5 and r["grad"] <= 1e-5 and r["param"] <= 1e-5, r


class _Conv1D(torch.nn.Module):
    """Hugging Face's GPT-2 linear: ``addmm(bias, x, w)``, the weight stored [in, out]."""

    def __init__(self, nin: int, nout: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(nin, nout) * 0.02)
        self.bias = torch.nn.Parameter(torch.randn(nout) * 0.02)

    def forward(self, x):
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).view(*x.shape[:-1], self.weight.shape[1])


class _Conv1DMLP(torch.nn.Module):
    def __init__(self, d: int = 32, h: int = 128):
        super().__init__()
        self.up, self.down = _Conv1D(d, h), _Conv1D(h, d)

    def forward(self, x, y):
        return ((self.down(torch.relu(self.up(x))) - y) ** 2).mean()


@pytest.mark.parametrize("axes,pins", [({"tp": 4}, [("up:addmm", "S(1)"), ("down:addmm_1", "P")]),
                                       ({"dp": 2, "tp": 2}, [("up:addmm", "S(0)S(1)"), ("down:addmm_1", "S(0)P")])],
                         ids=["tp4", "dp2xtp2"])
def test_gpt2_style_conv1d_runs_megatron_and_matches_single_device(axes, pins):
    """``addmm`` splits like a linear: column then row parallel, the row-parallel bias a partial share whose
    gradient is whole on every rank (no all-reduce over tp)."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 4, 32, generator=g), torch.randn(8, 4, 32, generator=g)
    r = parity(_Conv1DMLP(), (x, y), axes, constraints=pins)
    plan = r["plan"]
    assert str(plan.spec_of("up.weight"))[-4:] == "S(1)" and str(plan.spec_of("down.weight"))[-4:] == "S(0)"
    assert plan.whole_grads == {"p_down_bias": ("tp",)}
    assert r["loss"] <= 1e-5 and r["grad"] <= 1e-5 and r["param"] <= 1e-5, r


@pytest.mark.parametrize("name,strategy", [("gpt2", None), ("gpt2", "megatron"), ("llama", "megatron-sp"), ("mixtral", None)])
def test_hugging_face_models_match_single_device(name, strategy):
    """transformers' own GPT-2 (Conv1D, ``addmm``) and Llama (rotary, grouped-query attention, its RMSNorm from
    parts, positions made in forward with ``arange(device=...)``, an empty KV cache) and Mixtral (top-2 routing
    over 4 experts) on dp 2 x tp 2: the solver's plan, and ``handwritten``'s Megatron, which reads transformers'
    module names and Conv1D's (in, out) weights."""
    import autopar

    x, y = _inputs(batch=4, seq=16)
    model, plan = hugging_face(name), None
    if strategy:
        mesh = autopar.Mesh({"dp": 2, "tp": 2}, hardware="cpu-gloo")
        plan = autopar.handwritten(model, mesh, (x, y), "megatron", sequence_parallel=strategy.endswith("sp"))
    r = parity(model, (x, y), {"dp": 2, "tp": 2}, plan=plan, steps=2)
    assert r["loss"] <= 1e-5 and r["grad"] <= 1e-5 and r["param"] <= 1e-5, r
    spec = r["plan"].spec_of
    if name == "gpt2" and strategy:  # column then row parallel, in Conv1D's (in, out) layout
        layers = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
        assert [str(spec(f"lm.transformer.h.1.{p}.weight")) for p in layers] == ["RS(1)", "RS(0)", "RS(1)", "RS(0)"]
    if name == "llama":
        assert str(spec("lm.model.layers.1.self_attn.k_proj.weight")) == "RS(0)"
        assert str(spec("lm.model.layers.0.mlp.down_proj.weight")) == "RS(1)"


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_hugging_face_models_on_data_parallel_move_only_gradients(name):
    """On dp alone transformers' models keep every activation split by the batch: their empty KV cache (a legacy
    1-D cat), the attention's ``.contiguous()`` and the loss's label padding used to have no rule and were gathered
    over dp (Llama-3-8B at 64 A100s: 255 GiB a device, no plan)."""
    import autopar

    x, y = _inputs(batch=8, seq=16)
    plan = autopar.plan(hugging_face(name), autopar.Mesh({"dp": 4}, hardware="h100-80gb"), (x, y))
    # the loss's token count (a 128-byte mask, or its 8-byte sum) may move; no activation (>= 32 KiB here) does
    moved = [c for c in plan.collectives() if c.bytes > 1024 and not c.where.startswith(("grads", "zero"))]
    assert not moved, [f"{c.kind} {c.where} {c.bytes}" for c in moved]


def test_dropout_draws_one_mask_per_shard():
    """Every rank seeded alike draws in step: without reseeding, each data-parallel rank's sequences (and each
    tensor-parallel rank's heads) got the same mask. Now replicas draw one mask and shards independent ones, and
    the stream advances from call to call (recomputation replaying them: tests/test_passes.py)."""
    from tests._util import LMLoss

    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = LMLoss(transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=64, n_positions=32)))
    x, y = _inputs(batch=4, seq=16)
    x[2:], y[2:] = x[:2], y[:2]  # both data-parallel ranks get the same two sequences
    mesh = autopar.Mesh({"dp": 2, "tp": 2}, hardware="cpu-gloo")
    with pytest.warns(UserWarning, match="dropout"), fake_world(4), _compat.local_tensor_mode(4) as ltm:
        pm = autopar.parallelize(model, mesh, (x, y))
        losses = []
        for _ in range(2):
            loss = pm(*pm.local_inputs(x, y))
            with ltm.disable():
                losses.append([float(v) for _, v in sorted(_compat.local_values(loss.detach()).items())])
    for ls in losses:  # ranks 0, 1: dp 0 (tp 0, 1); ranks 2, 3: dp 1
        assert ls[0] == ls[1] and ls[2] == ls[3] and abs(ls[0] - ls[2]) > 1e-4, ls
    assert losses[0] != losses[1]


def test_dropout_is_named_when_the_ranks_draw_their_own_masks():
    """Hugging Face's GPT-2 drops out by default (p = 0.1: after the embeddings, the attention weights (in sdpa),
    the attention's and the MLP's outputs): ``parallelize`` says where and why the run cannot equal
    single-device training number for number; in eval mode it is silent and exact."""
    import warnings

    from tests._util import LMLoss

    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = LMLoss(transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=64, n_positions=32)))
    x, y = _inputs(batch=4, seq=16)
    with pytest.warns(UserWarning, match=r"7 op\(s\) draw random numbers \(dropout with p > 0 and the like; the first: lm.transformer.drop"):
        parity(model, (x, y), {"dp": 2, "tp": 2}, steps=1)
    model.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        r = parity(model, (x, y), {"dp": 2, "tp": 2}, steps=1)
    assert r["loss"] <= 1e-5 and r["grad"] <= 1e-5, r


@pytest.mark.parametrize("axes,spec,zero", [({"ep": 4}, "S(0)", None), ({"dp": 2, "ep": 2}, "RS(0)", 3), ({"ep": 2, "tp": 2}, "S(0)R", None)],
                         ids=["ep4", "dp2xep2-zero3", "ep2xtp2"])
def test_expert_parallel_moe_matches_single_device(axes, spec, zero):
    """Expert parallelism: a Mixtral's stacked experts split along their expert dim on ep, each rank's tokens sent
    to their experts' ranks and back by all-to-all (the routing's dispatch and combine kept split by the batch),
    beside data parallelism on dp or tensor parallelism on tp. With ZeRO-3 over dp x ep the experts, already
    split on ep, shard over dp alone (``zero.effective``); the other weights over both."""
    from models.mixtral import Mixtral, MixtralConfig

    torch.manual_seed(0)
    model = Mixtral(MixtralConfig.tiny())
    split = "".join("S(0)" if a != "tp" else "R" for a in axes)
    pins = [("layers.*.moe.w[123]", spec), ("layers.*.moe:matmul*", split)]
    if zero:
        pins.append(autopar.ZeroPin("*", zero, shard=("dp", "ep")))
    r = parity(model, _inputs(), axes, constraints=pins)
    plan = r["plan"]
    assert {(c.kind, c.axis, c.phase) for c in plan.collectives() if c.kind == "all_to_all"} == {
        ("all_to_all", "ep", "forward"), ("all_to_all", "ep", "backward")}
    if zero:
        shards = {plan.nodes[p].path.removesuffix(".weight").rsplit(".", 1)[-1]: b.shard_axes for b in plan.zero_buckets for p in b.params}
        assert shards["w1"] == shards["w2"] == ("dp",) and shards["wq"] == ("dp", "ep"), shards
    assert r["loss"] <= 1e-5 and r["grad"] <= 1e-5 and r["param"] <= 1e-5, r


@pytest.mark.parametrize("axes", [{"tp": 4}, {"dp": 2, "tp": 2}])
def test_a_loss_computed_outside_the_model_reads_the_rows_of_its_local_inputs(axes):
    """A model that returns logits hands each rank the rows of its own ``local_inputs`` (as DDP does), so the targets
    cut the same way fit them: the solver used to split the logits by rows over tp, where the inputs are whole
    (ValueError: batch_size 32 against 64). With each rank's mean loss, averaged as DDP averages, the gradients are
    the single-device model's."""
    import torch.nn.functional as F

    model = _model("gpt")
    reference = copy.deepcopy(model)
    x, y = _inputs(batch=8)
    mesh = autopar.Mesh(axes)
    with fake_world(mesh.size), _compat.local_tensor_mode(mesh.size) as ltm:
        pm = autopar.parallelize(model, mesh, (x,))
        assert pm.plan.output_specs[0] == pm.plan.input_spec, (pm.plan.output_specs, pm.plan.input_spec)
        (xl,), (yl,) = pm.local_inputs(x), pm.local_inputs(y)
        logits = pm(xl)
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), yl.reshape(-1)).backward()
        grads = pm.full_grads()
        with ltm.disable():
            F.cross_entropy(reference(x).reshape(-1, 64), y.reshape(-1)).backward()
            for k, p in reference.named_parameters():
                assert float((grads[k] - p.grad).abs().max()) <= 1e-6, k
