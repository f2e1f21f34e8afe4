"""Parity with single-device training in real processes: gloo over loopback, launched with torch's launcher."""

from __future__ import annotations

import pytest

from tests._util import torchrun


@pytest.mark.parametrize("nproc,expected", [(2, 22), (4, 24)])
def test_real_gloo_processes_match_single_device(nproc, expected):
    lines = torchrun("tests.gloo_worker", nproc)
    # every redistribution between R / S(d) layouts, through real all-gathers, all-to-alls and chunks
    assert f"REDISTRIBUTE {16 * 16 if nproc == 4 else 16}" in lines
    rows = [line.split()[1:] for line in lines if line.startswith("PARITY")]
    if nproc == 4:  # autopar.compare measured in real processes
        compared = {line.split()[1]: line.split()[2:] for line in lines if line.startswith("COMPARE ")}
        assert set(compared) == {"auto", "megatron", "torch:megatron"}, lines
        for name, (n, nbytes, n_pred, bytes_pred, dl, dg) in compared.items():
            assert max(float(dl), float(dg)) <= 1e-5, (name, dl, dg)
            if not name.startswith("torch:"):  # what autopar launches is what it priced
                assert int(n) == int(n_pred) and float(nbytes) == pytest.approx(float(bytes_pred)), (name, n, n_pred, nbytes, bytes_pred)
        under = {line.split()[1]: line.split()[2:] for line in lines if line.startswith("COMPARE_MP")}
        assert set(under) == {"auto", "fsdp", "torch:fsdp"}, lines
        for name, (error, stamped, dtype, dl, dg) in under.items():  # loss and gradients as one device under the policy
            assert error == "-" and stamped == "True" and dtype == "float32", (name, error, stamped, dtype)
            assert 0 <= max(float(dl), float(dg)) <= 1e-5, (name, dl, dg)
        # dropout in real processes: replicas (ranks 0, 1 and 2, 3 over tp) draw one mask, the two data-parallel
        # shards of the same sequences independent ones; full recomputation replays them (gradients equal); a rank
        # seeded apart is named
        (drop,) = [line.split()[1:] for line in lines if line.startswith("DROPOUT")]
        l0, l1, l2, l3, replay, warned = map(float, drop)
        assert l0 == l1 and l2 == l3 and abs(l0 - l2) > 1e-4 and replay == 0.0 and warned == 1, drop
    assert len(rows) == expected, rows
    # gradient accumulation under no_sync in real processes (ZeRO-3 x tp: held gradients reduce-scattered later)
    assert nproc == 2 or {r[0] for r in rows if r[2] == "zero3+megatron+no_sync"} == {"gpt", "llama"}, rows
    # mixed precision in real processes (fp64 masters, fp32 compute and reduction): DDP's buckets and ZeRO-3's
    assert {r[0] for r in rows if r[2] == ("zero0+mp" if nproc == 2 else "zero3+megatron+mp+no_sync")} == {"gpt", "llama"}, rows
    for name, mesh, variant, dl, dg, dp in rows:
        assert max(float(dl), float(dg), float(dp)) <= 1e-5, (name, mesh, variant, dl, dg, dp)
