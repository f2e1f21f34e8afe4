"""The ``autopar`` command: plan from the registry, write JSON, and the main job's distributed half."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import autopar
from autopar.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_plan_command_prints_a_table_and_writes_json(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "gpt-tiny", "--mesh", "dp=2,tp=2", "--hardware", "cpu-gloo", "--dtype", "fp32", "--batch", "4",
                 "--json", str(out), "--explain", "h.0.attn.c_attn"]) == 0
    text = capsys.readouterr().out
    assert "mesh dp=2 x tp=2 on cpu-gloo" in text and "<- chosen" in text and "planned in" in text
    plan = autopar.Plan.from_json(out.read_text())
    assert json.loads(out.read_text())["format"] == "autopar.plan" and plan.mesh.size == 4


def test_bad_command_line_input_is_a_clear_message_not_a_traceback(capsys):
    # an axis of size 0 when the default batch is worked out from the mesh; a zero batch or sequence
    assert main(["plan", "gpt-tiny", "--mesh", "dp=2,tp=0"]) == 2
    assert "MeshError: mesh axis 'tp' has size 0" in capsys.readouterr().err
    for flag, value, what in (("--batch", "0", "sequences"), ("--seq", "-3", "tokens per sequence")):
        with pytest.raises(SystemExit) as e:
            main(["plan", "gpt-tiny", "--mesh", "dp=2", flag, value])
        assert f"autopar: {flag} wants a positive number of {what}" in str(e.value) and f"got {value}" in str(e.value)
    # each refused before any planning, with what was wrong and how to fix it
    for argv, says in ((["--mesh", "dp=2,dp=2"], "names axis 'dp' twice"),
                       (["--mesh", "dp=2", "--memory-budget", "0"], "--memory-budget wants a positive number"),
                       (["--mesh", "dp=2", "--memory-budget", "nan"], "--memory-budget wants a positive number"),
                       (["--mesh", "dp=2", "--json", "/nonexistent-autopar/p.json"], "the folder /nonexistent-autopar does not exist"),
                       (["--cluster", "1x2", "--explain", "h.0"], "--explain reads a plan on one mesh")):
        with pytest.raises(SystemExit) as e:
            main(["plan", "gpt-tiny", *argv])
        assert says in str(e.value), (argv, str(e.value))
        # exit status 2 as argparse's refusals and autopar's errors (a SystemExit with a message exited 1), the
        # message on stderr
        assert e.value.code == 2 and says in capsys.readouterr().err
    for spec, says in (("autopar_no_such_module:make", "ModuleNotFoundError"), ("os:no_such_callable", "AttributeError")):
        with pytest.raises(SystemExit) as e:
            main(["plan", spec, "--mesh", "dp=2"])
        assert f"cannot load the model {spec!r} ({says}" in str(e.value) and "module:callable" in str(e.value)
    with pytest.raises(SystemExit, match=r"os.path:join must be callable without arguments \(missing a required argument"):
        main(["plan", "os.path:join", "--mesh", "dp=2"])  # (a callable wanting arguments raised its TypeError's traceback)
    capsys.readouterr()
    assert main(["compare", "gpt-tiny", "--mesh", "dp=2", "--plans", "auto,fdsp"]) == 2  # (it was a row: exit 0)
    assert "plan entry 'fdsp': unknown strategy" in capsys.readouterr().err
    # rows of features (an MLP) have no sequence: the header says so, not "seq 16 (--seq 2048: the model's context)"
    assert main(["plan", "mlp-tiny", "--mesh", "dp=2", "--hardware", "cpu-gloo"]) == 0
    assert "(global batch 2 x 16 features, " in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--nproc wants a positive number"):
        main(["demo", "--nproc", "0"])
    # (each was a traceback: the demo's batch of 16 cut 3 ways or over no step, a superscript digit, a torch strategy
    # torch's API does not realise shown as a row of dashes)
    for argv, says in ((["demo", "--nproc", "3"], "does not divide the demo's global batch of 16: give one of 1, 2, 4, 8, 16"),
                       (["demo", "--steps", "0"], "--steps wants a positive number"),
                       (["plan", "gpt-tiny", "--mesh", "dp=\u00b2"], "--mesh wants name=size pairs"),
                       (["plan", "gpt-tiny", "--mesh", "dp=99999999999999999999"], "more than autopar plans for"),
                       (["plan", "gpt-tiny", "--cluster", "1x\u00b2"], "--cluster wants NODESxGPUS_PER_NODE")):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert says in str(e.value), (argv, str(e.value))
    assert main(["compare", "gpt-tiny", "--mesh", "dp=2", "--plans", "auto,torch:bogus"]) == 2
    assert "torch's own API realises torch:ddp, torch:fsdp" in capsys.readouterr().err


def test_json_replaces_a_plan_and_nothing_else(tmp_path, capsys):
    """--json writes beside the file and renames over it (a run stopped midway emptied the old plan: the file was
    opened for writing before the plan was serialised), replaces a plan but refuses any other file there (it was
    overwritten silently), refuses a folder or a place it cannot write before planning (they failed with a traceback
    after it), and is written before --explain reads the plan (a name explain did not know lost the plan)."""
    argv = ["plan", "gpt-tiny", "--mesh", "dp=2", "--hardware", "cpu-gloo", "--batch", "4"]
    mine = tmp_path / "notes.json"
    mine.write_text('{"my": "notes"}')
    with pytest.raises(SystemExit, match="exists and is not an autopar plan; nothing was planned"):
        main(argv + ["--json", str(mine)])
    assert mine.read_text() == '{"my": "notes"}'
    with pytest.raises(SystemExit, match="is a folder; give a file name in it"):
        main(argv + ["--json", str(tmp_path)])
    out = tmp_path / "plan.json"
    out.write_text("")  # (an empty file is no one's loss)
    assert main(argv + ["--json", str(out)]) == 0
    first = out.read_text()
    assert main(argv + ["--batch", "8", "--json", str(out)]) == 0  # a plan replaced by another
    assert out.read_text() != first and autopar.Plan.from_json(out.read_text()).mesh.size == 2
    out.unlink()
    assert main(argv + ["--json", str(out), "--explain", "no.such.module"]) == 2
    assert out.exists() and autopar.Plan.from_json(out.read_text()).mesh.size == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.json", "plan.json"]  # no temporary file left


def test_plan_command_on_a_real_size_model_is_fast(capsys):
    assert main(["plan", "llama3-8b", "--mesh", "dp=4,tp=2", "--batch", "8", "--seq", "4096"]) == 0
    text = capsys.readouterr().out
    assert "[layers.0] x32" in text and "layers.0.attention.wq.weight" in text
    seconds = float(text.split("planned in ")[1].split()[0])
    assert seconds < 20


def test_plan_command_searches_a_cluster(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "megatron-1.7b", "--cluster", "4x8", "--hardware", "a100-80gb", "--batch", "512", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "on 4 x 8 a100-80gb (32 devices" in text and "screened (best first)" in text and "planned in" in text
    assert autopar.Plan.from_json(out.read_text()).mesh.size == 32
    import pytest

    with pytest.raises(SystemExit, match="one of them"):
        main(["plan", "gpt-tiny", "--cluster", "1x4", "--mesh", "dp=4"])


def test_a_seq_longer_than_the_models_context_extends_it(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "llama-tiny", "--cluster", "1x8", "--hardware", "h100-80gb", "--batch", "1", "--seq", "4096",
                 "--json", str(out)]) == 0  # llama-tiny's context is 16 tokens
    assert "global batch 1 x seq 4096" in capsys.readouterr().out
    plan = autopar.Plan.from_json(out.read_text())
    assert {n.shape for n in plan.nodes.values() if n.op == "input"} == {(1, 4096)}


def test_the_main_jobs_plan_step_runs_with_its_own_arguments(capsys):
    import argparse

    from autopar.cli import cmd_plan

    # the fields cmd_main passes (no --cluster among them)
    ns = argparse.Namespace(model="gpt-tiny", mesh="dp=2,tp=2", hardware="cpu-gloo", batch=4, seq=16, dtype="fp32",
                            memory_budget=None, json=None, explain="h.0.attn.c_attn")
    assert cmd_plan(ns) == 0 and "planned in" in capsys.readouterr().out


def test_demo_trains_on_local_gloo_ranks_like_one_device():
    env = dict(os.environ, PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-m", "autopar", "demo", "--nproc", "2", "--steps", "2"], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "equal to single-device training" in out.stdout and "validation (eval mode, no_grad)" in out.stdout


def test_plan_and_compare_take_a_mixed_precision_policy(capsys):
    assert main(["plan", "gpt-tiny", "--mesh", "dp=2,tp=2", "--hardware", "cpu-gloo", "--batch", "4", "--seq", "16",
                 "--mixed-precision", "bf16/fp32"]) == 0
    text = capsys.readouterr().out
    # the model is built in fp32 (the master copy), planned as it computes, and every compared row under the policy
    assert "fp32 parameters, bf16 compute, fp32 reduce" in text and text.count("mixed precision bf16 compute, fp32 reduce") == 2
    assert main(["compare", "gpt-tiny", "--mesh", "dp=2", "--hardware", "cpu-gloo", "--batch", "4", "--seq", "16",
                 "--plans", "auto,fsdp", "--mixed-precision", "bf16"]) == 0
    assert "mixed precision bf16 compute, bf16 reduce" in capsys.readouterr().out
    assert main(["plan", "gpt-tiny", "--mesh", "dp=2", "--mixed-precision", "int8"]) == 2
    assert "param_dtype='int8': give a floating dtype" in capsys.readouterr().err
    assert main(["plan", "gpt-tiny", "--mesh", "dp=2", "--dtype", "bf16", "--mixed-precision", "fp32"]) == 2
    assert "narrower than MixedPrecision's param_dtype" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="PARAM or PARAM/REDUCE"):
        main(["plan", "gpt-tiny", "--mesh", "dp=2", "--mixed-precision", "bf16/fp32/fp64"])
