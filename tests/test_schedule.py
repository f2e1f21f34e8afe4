"""Pipeline schedules: action orders, in-flight microbatches, and the simulated bubble against the textbook."""

from __future__ import annotations

import pytest

from autopar import schedule


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", [(2, 2), (2, 8), (4, 4), (4, 8), (4, 32), (8, 16)])
def test_bubble_of_gpipe_and_1f1b_is_p_minus_1_over_m_plus_p_minus_1(name, p, m):
    t = schedule.simulate(name, p, m, 1, [1.0] * p, [2.0] * p)
    assert t.bubble == pytest.approx((p - 1) / (m + p - 1), rel=1e-12)
    assert t.step == pytest.approx((m + p - 1) * 3.0)


@pytest.mark.parametrize("p,m,v", [(2, 2, 2), (2, 4, 2), (4, 4, 2), (4, 8, 2), (4, 8, 3), (4, 16, 4), (8, 16, 2)])
def test_bubble_of_interleaved_is_p_minus_1_over_v_m_plus_p_minus_1(p, m, v):
    S = p * v
    t = schedule.simulate("interleaved", p, m, v, [1.0 / v] * S, [2.0 / v] * S)
    assert t.bubble == pytest.approx((p - 1) / (v * m + p - 1), rel=1e-12)


def test_interleaving_shrinks_the_bubble_and_1f1b_keeps_fewer_microbatches_in_flight():
    p, m = 4, 8
    one = schedule.simulate("1f1b", p, m, 1, [1.0] * p, [2.0] * p)
    two = schedule.simulate("interleaved", p, m, 2, [0.5] * 8, [1.0] * 8)
    assert two.step < one.step
    assert schedule.in_flight("gpipe", p, m) == [m] * p  # every forward before any backward
    assert schedule.in_flight("1f1b", p, m) == [4, 3, 2, 1]  # rank r keeps p - r
    assert schedule.in_flight("interleaved", p, m, 2) == [11, 9, 7, 5]  # (v - 1) p + 2 (p - 1 - r) + 1 stage-microbatches


def test_every_action_runs_once_and_transfers_delay_the_step():
    p, m, v = 4, 8, 2
    for name, vv in (("gpipe", 1), ("1f1b", 1), ("interleaved", v)):
        acts = schedule.actions(name, p, m, vv)
        seen = [(a.kind, a.stage, a.microbatch) for seq in acts for a in seq]
        assert len(seen) == len(set(seen)) == 2 * p * vv * m
        for r, seq in enumerate(acts):
            assert all(a.stage % p == r for a in seq)
        free = schedule.simulate(name, p, m, vv, [1.0] * p * vv, [2.0] * p * vv)
        slow = schedule.simulate(name, p, m, vv, [1.0] * p * vv, [2.0] * p * vv, [0.5] * p * vv)
        assert slow.step > free.step


def test_a_slow_stage_sets_the_pace():
    fast = schedule.simulate("1f1b", 4, 16, 1, [1.0] * 4, [2.0] * 4)
    slow = schedule.simulate("1f1b", 4, 16, 1, [1.0, 1.0, 2.0, 1.0], [2.0, 2.0, 4.0, 2.0])
    # the slowest stage runs every microbatch (16 x 6), and the step is within the textbook bound
    # (m - 1) x 6 + the sum of the stages' 3 + 3 + 6 + 3
    assert 16 * 6 <= slow.step <= 15 * 6 + 15 and slow.step > fast.step


def test_text_timeline_and_unrunnable_schedules():
    t = schedule.simulate("1f1b", 2, 2, 1, [1.0, 1.0], [2.0, 2.0])
    text = schedule.text_timeline(t, width=18)
    assert text.splitlines()[0].startswith("  rank 0 |AABB") and "a" in text and "." in text
    assert schedule.check("1f1b", 4, 2, 1) and "at least as many microbatches" in schedule.check("1f1b", 4, 2, 1)
    assert "multiple of the ranks" in schedule.check("interleaved", 4, 6, 2)
    assert schedule.check("interleaved", 4, 8, 2) is None and schedule.check("nope", 2, 2, 1).startswith("unknown")


def test_in_flight_closed_forms_equal_the_simulated_action_order():
    for p in (2, 3, 4, 8):
        for m in (1, 2, 4, 8, 12, 16):
            for name, vs in (("gpipe", (1,)), ("1f1b", (1,)), ("interleaved", (2, 3, 4))):
                for v in vs:
                    if schedule.check(name, p, m, v) is None:
                        assert schedule.in_flight(name, p, m, v) == schedule.in_flight_simulated(name, p, m, v), (name, p, m, v)
                        beside = schedule.in_flight_beside_grads(name, p, m, v)
                        assert beside == schedule.in_flight_beside_grads_simulated(name, p, m, v), (name, p, m, v)
    # every forward before any backward: one microbatch fewer once gradients exist; 1F1B's steady state: the same
    assert schedule.in_flight_beside_grads("gpipe", 2, 4) == [3, 3]
    assert schedule.in_flight_beside_grads("1f1b", 2, 4) == schedule.in_flight("1f1b", 2, 4) == [2, 1]


@pytest.mark.parametrize("name,p,m,v", [("gpipe", 3, 4, 1), ("1f1b", 2, 2, 1), ("1f1b", 4, 8, 1), ("interleaved", 2, 4, 2)])
def test_ranks_sharing_cores_at_full_speed_simulate_as_devices_of_their_own(name, p, m, v):
    n = p * v
    fwd, bwd, send = [1.0 + 0.1 * s for s in range(n)], [2.0 + 0.3 * s for s in range(n)], [0.2] * n
    own = schedule.simulate(name, p, m, v, fwd, bwd, send)
    shared = schedule._simulate_shared(schedule.actions(name, p, m, v), n, fwd, bwd, send, [1.0] * p)
    assert shared.step == pytest.approx(own.step, rel=1e-12)
    assert shared.busy == pytest.approx(own.busy, rel=1e-12)
    for a, b in zip(own.spans, shared.spans):
        assert [x[0] for x in a] == [x[0] for x in b]
        assert [x[1:] for x in a] == [pytest.approx(x[1:], rel=1e-12, abs=1e-12) for x in b]


def test_a_stage_alone_in_the_bubble_runs_at_the_cores_its_idle_neighbour_leaves():
    # 1F1B, 2 ranks, 2 microbatches, forward 1 and backward 2 at the rate both ranks computing get; alone, twice
    # that. By hand: F0 alone [0, .5]; F1 on rank 0 and F0 on rank 1 together [.5, 1.5]; rank 1's B0 alone
    # [1.5, 2.5]; rank 0's B0 [2.5, 4.5] beside rank 1's F1 [2.5, 3.5] and then B1 [3.5, 5]; rank 0's B1 alone
    # [5, 6] -- against 9 when a stage alone runs no faster
    t = schedule.simulate("1f1b", 2, 2, 1, [1.0, 1.0], [2.0, 2.0], speed=[2.0, 1.0])
    assert t.step == pytest.approx(6.0)
    assert [(a.kind, a.microbatch, s, e) for a, s, e in t.spans[0]] == [
        ("F", 0, 0.0, 0.5), ("F", 1, 0.5, 1.5), ("B", 0, 2.5, 4.5), ("B", 1, 5.0, 6.0)]
    assert [(a.kind, a.microbatch, s, e) for a, s, e in t.spans[1]] == [
        ("F", 0, 0.5, 1.5), ("B", 0, 1.5, 2.5), ("F", 1, 2.5, 3.5), ("B", 1, 3.5, 5.0)]
    assert schedule.simulate("1f1b", 2, 2, 1, [1.0, 1.0], [2.0, 2.0]).step == pytest.approx(9.0)


@pytest.mark.parametrize("p,v", [(2, 2), (3, 2), (4, 3), (2, 4)])
def test_a_sent_gradient_is_let_go_only_once_its_receiver_has_said_so(p, v):
    """``gradient_send_releases``: a rank waits for a gradient it sent back (stage s, microbatch k) as it starts an
    action after the send that reads a transfer the previous stage's rank started after its backward of (s - 1, k),
    which it ran on that very gradient: so the receive was posted and the wait cannot block. Each send is listed
    once at most; those never listed wait for the step's end (the previous rank's cooldown sends nothing back)."""
    for m in (p, 2 * p, 3 * p):
        orders = schedule.actions("interleaved", p, m, v)
        pos = [{(a.kind, a.stage, a.microbatch): i for i, a in enumerate(seq)} for seq in orders]
        releases = schedule.gradient_send_releases(orders, p)
        listed = 0
        for r, seq in enumerate(orders):
            q = (r - 1) % p
            seen = set()
            for at, sends in releases[r].items():
                reader = seq[at]
                # the transfer the action at ``at`` reads, and when q started it
                started = (pos[q][("F", reader.stage - 1, reader.microbatch)] if reader.kind == "F"
                           else pos[q][("B", reader.stage + 1, reader.microbatch)])
                assert (reader.stage - 1 if reader.kind == "F" else reader.stage + 1) % p == q
                for j in sends:
                    sent = seq[j]
                    assert sent.kind == "B" and sent.stage > 0 and j < at and j not in seen
                    assert started > pos[q][("B", sent.stage - 1, sent.microbatch)]
                    seen.add(j)
            listed += len(seen)
        sends = sum(a.kind == "B" and a.stage > 0 for seq in orders for a in seq)
        # most are let go early (with one round of microbatches every forward may run first: none), the last few
        # wait for the end
        assert listed < sends and (listed > 0 or m == p), (m, listed, sends)
