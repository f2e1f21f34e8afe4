"""Pipeline schedules: the order each rank runs its forward and backward steps in, and their simulated timeline.

In: the schedule name (``gpipe``, ``1f1b``, ``interleaved``), the number of ranks on the pipeline axis ``p``,
microbatches ``m``, stages per rank ``v`` (1 unless interleaved), and per stage its forward and backward seconds
per microbatch and the seconds of the point-to-point transfer to the next stage.
Out: ``actions(...)``: per rank, the list of (F or B, stage, microbatch) in the order torch.distributed.pipelining
runs them (ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B with ``m % p == 0``); ``simulate(...)``: the start
and end of every action when each waits for its rank and for its data (the previous stage's forward, the next
stage's backward, plus the transfer), hence the step time and the bubble; ``in_flight(...)``: the most
microbatches whose activations a rank keeps at once; ``text_timeline`` and ``png_timeline`` draw it.

Stage ``s`` runs on rank ``s % p`` (interleaved: rank r holds stages r, r + p, ...), as torch places them.
With equal stages and free transfers the simulated bubble fraction is the textbook one: (p - 1) / (m + p - 1) for
GPipe and 1F1B, (p - 1) / (v m + p - 1) for interleaved 1F1B.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

SCHEDULES = ("gpipe", "1f1b", "interleaved")


@dataclass(frozen=True)
class Action:
    kind: str  # "F" or "B"
    stage: int
    microbatch: int


def _warmup(schedule: str, rank: int, p: int, m: int, v: int) -> int:
    if schedule == "gpipe":
        return m
    if schedule == "1f1b":
        return min(m, p - rank - 1)
    # interleaved (torch's _get_warmup_ops with p microbatches per round)
    return min((v - 1) * p + 2 * (p - 1 - rank), m * v)


def check(schedule: str, p: int, m: int, v: int) -> str | None:
    """Why (schedule, p, m, v) cannot run under torch.distributed.pipelining, or None if it can."""
    if schedule not in SCHEDULES:
        return f"unknown schedule {schedule!r}; known: {', '.join(SCHEDULES)}"
    if m < 1:
        return "needs at least one microbatch"
    if schedule != "interleaved" and v != 1:
        return f"{schedule} runs one stage per rank (virtual stages {v})"
    if schedule == "1f1b" and m < p:
        return f"1f1b needs at least as many microbatches as ranks (m={m} < p={p})"
    if schedule == "interleaved" and (v < 2 or m % p):
        return f"interleaved needs 2+ stages per rank and microbatches a multiple of the ranks (v={v}, m={m}, p={p})"
    return None


def actions(schedule: str, p: int, m: int, v: int = 1) -> list[list[Action]]:
    """Per rank, its actions in run order."""
    out = []
    for r in range(p):
        n = m * v
        fwd, bwd = [], []
        for k in range(n):
            if schedule == "interleaved":
                chunk, mb = (k // p) % v, (k // (p * v)) * p + k % p
                fwd.append(Action("F", chunk * p + r, mb))
                bchunk = v - 1 - (k // p) % v
                bwd.append(Action("B", bchunk * p + r, mb))
            else:
                fwd.append(Action("F", r, k))
                bwd.append(Action("B", r, k))
        w = _warmup(schedule, r, p, m, v)
        seq = fwd[:w]
        fi, bi = w, 0
        while fi < n:  # steady state: one forward, one backward
            seq.append(fwd[fi])
            fi += 1
            seq.append(bwd[bi])
            bi += 1
        seq += bwd[bi:]
        out.append(seq)
    return out


def in_flight(schedule: str, p: int, m: int, v: int = 1) -> list[int]:
    """Per rank, the most forwards whose backward has not run yet (each keeps one stage-microbatch of activations).

    Closed forms (GPipe m; 1F1B min(m, p - r); interleaved min(m v, (v - 1) p + 2 (p - 1 - r) + 1)) -- the cluster
    search asks this thousands of times -- which ``in_flight_simulated`` confirms over a grid in the tests."""
    if schedule == "gpipe":
        return [m] * p
    if schedule == "1f1b":
        return [min(m, p - r) for r in range(p)]
    if schedule == "interleaved":
        return [min(m * v, (v - 1) * p + 2 * (p - 1 - r) + 1) for r in range(p)]
    return in_flight_simulated(schedule, p, m, v)


def in_flight_beside_grads(schedule: str, p: int, m: int, v: int = 1) -> list[int]:
    """Per rank, the most forwards whose backward has not run yet once the rank's first backward has run: from then
    on its accumulated gradients exist (before it, none: ``opt.zero_grad()`` drops them). ``in_flight`` where the
    rank runs a backward before its last forward; one fewer where every forward comes first (GPipe; 1F1B with no
    more microbatches than stages after the rank). Closed form, ``min(in flight, m v - 1)``, which
    ``in_flight_beside_grads_simulated`` confirms over a grid in the tests."""
    return beside_grads(in_flight(schedule, p, m, v), m, v)


# sent-back gradients a rank holds beside its microbatches in flight at the steady state's fullest moment, where
# they are let go at ``gradient_send_releases`` (``tests/test_schedule.py`` walks a grid of p, m, v)
RELEASED_PENDING = 2


def sent_gradients_held(schedule: str) -> str | None:
    """How long a rank holds each gradient it sends back (a send's work holds the tensor it sends until waited, and
    torch waits late): ``"end"`` -- to the end of the step's backward (GPipe waits after its last backward);
    ``"released"`` -- torch's runtime schedules (interleaved 1F1B) wait at the step's end, but autopar's stages
    post these sends themselves and wait for each once it has surely arrived (``gradient_send_releases``), so at
    most ``RELEASED_PENDING`` are held at the steady state's fullest moment; None -- 1F1B waits for each with its
    next transfer (one in flight, priced with the backward: ``pipeline.receive_buffers``)."""
    return {"gpipe": "end", "interleaved": "released"}.get(schedule)


def gradient_send_releases(orders: list[list[Action]], p: int) -> list[dict[int, list[int]]]:
    """When a rank may wait for each gradient it sent back, without blocking: per rank, {index of one of its actions:
    indices of its backwards whose sends to wait for as that action starts}. ``orders``: each rank's actions in run
    order (``actions``, or torch's own); stage s on rank s mod p.

    A send can be waited for once its receive is posted: the transfer then needs nothing more from either side.
    The previous stage's rank q posts it before the backward that reads it, and then tells this rank so by any
    transfer it starts after that backward -- a forward's output (every forward of q's but the last stage's goes to
    this rank), or on 2 ranks a gradient too. So the send is waited for as this rank starts the first action
    reading such a transfer after the send; a send with none (q's cooldown runs backwards alone) waits for the end
    of the step. The first stage sends nothing back."""
    stages = p * max((a.stage // p + 1 for seq in orders for a in seq), default=1)
    pos = [{(a.kind, a.stage, a.microbatch): i for i, a in enumerate(seq)} for seq in orders]
    out: list[dict[int, list[int]]] = []
    for r, seq in enumerate(orders):
        q = (r - 1) % p
        msgs = []  # (index on q, index on r of the action reading it), in q's order
        for i, a in enumerate(orders[q]):
            if a.kind == "F" and a.stage + 1 < stages and (a.stage + 1) % p == r:
                msgs.append((i, pos[r][("F", a.stage + 1, a.microbatch)]))
            elif a.kind == "B" and a.stage > 0 and (a.stage - 1) % p == r:
                msgs.append((i, pos[r][("B", a.stage - 1, a.microbatch)]))
        at: dict[int, list[int]] = {}
        for j, a in enumerate(seq):
            if a.kind != "B" or a.stage == 0:
                continue
            iq = pos[q][("B", a.stage - 1, a.microbatch)]
            k = bisect.bisect_right(msgs, (iq, len(seq)))
            while k < len(msgs) and msgs[k][1] <= j:  # (read before the send was made: no news of it)
                k += 1
            if k < len(msgs):
                at.setdefault(msgs[k][1], []).append(j)
        out.append(at)
    return out


def beside_grads(flights: list[int], m: int, v: int = 1) -> list[int]:
    """``in_flight_beside_grads`` from the ranks' ``in_flight`` counts ``flights``."""
    return [min(f, m * v - 1) for f in flights]


def _simulated_peaks(schedule: str, p: int, m: int, v: int, after_backward: bool) -> list[int]:
    """Per rank, the most forwards whose backward has not run, counted on the schedule's own action order (from the
    rank's first backward on, where ``after_backward``)."""
    res = []
    for seq in actions(schedule, p, m, v):
        live = peak = 0
        seen = not after_backward
        for a in seq:
            seen = seen or a.kind == "B"
            live += 1 if a.kind == "F" else -1
            if seen:
                peak = max(peak, live)
        res.append(peak)
    return res


def in_flight_beside_grads_simulated(schedule: str, p: int, m: int, v: int = 1) -> list[int]:
    """``in_flight_beside_grads`` counted on the schedule's own action order."""
    return _simulated_peaks(schedule, p, m, v, True)


def in_flight_simulated(schedule: str, p: int, m: int, v: int = 1) -> list[int]:
    """``in_flight`` counted on the schedule's own action order."""
    return _simulated_peaks(schedule, p, m, v, False)


@dataclass(frozen=True)
class Timeline:
    step: float  # seconds from the first forward to the last backward
    busy: tuple[float, ...]  # per rank, seconds computing
    spans: tuple[tuple[tuple[Action, float, float], ...], ...]  # per rank: (action, start, end)

    @property
    def bubble(self) -> float:
        """Fraction of rank-time idle: 1 - mean busy / step."""
        if self.step <= 0:
            return 0.0
        return 1.0 - sum(self.busy) / (len(self.busy) * self.step)


def simulate(schedule: str, p: int, m: int, v: int, fwd: list[float], bwd: list[float], send: list[float] | None = None,
             speed: "list[float] | None" = None) -> Timeline:
    """Run the schedule's actions in order on each rank: an action starts when its rank is free and its input has
    arrived (forward: the previous stage's forward of the microbatch + the transfer; backward: this stage's forward
    and the next stage's backward + the transfer). ``send[s]``: seconds to move stage s's output to stage s + 1
    (the gradient goes back at the same cost). ``speed[k - 1]``: how much faster than ``fwd`` / ``bwd`` say an
    action runs while k ranks compute (ranks sharing cores, ``Hardware.busy_speedup``: a stage alone in the bubble
    gets the cores its idle neighbours leave); None: every action at its own seconds."""
    n_stages = p * v
    send = send or [0.0] * n_stages
    seqs = actions(schedule, p, m, v)
    if speed is not None and any(x != 1.0 for x in speed[:p]):
        return _simulate_shared(seqs, n_stages, fwd, bwd, send, speed)
    # end times by [stage][microbatch], -1 until the action has run (lists, not a dict of tuples: a 1T-parameter
    # plan simulates 128 ranks x 1024 microbatches, twice)
    n_mb = 1 + max((a.microbatch for seq in seqs for a in seq), default=0)
    done_f = [[-1.0] * n_mb for _ in range(n_stages)]
    done_b = [[-1.0] * n_mb for _ in range(n_stages)]
    last = n_stages - 1
    pos = [0] * p
    free = [0.0] * p
    spans: list[list[tuple[Action, float, float]]] = [[] for _ in range(p)]
    busy = [0.0] * p
    remaining = sum(len(s) for s in seqs)
    while remaining:
        progressed = False
        for r in range(p):
            seq, i, t_free, out = seqs[r], pos[r], free[r], spans[r]
            while i < len(seq):
                a = seq[i]
                st, mb = a.stage, a.microbatch
                if a.kind == "F":  # the previous stage's forward of this microbatch, then its transfer
                    if st == 0:
                        ready = 0.0
                    else:
                        t = done_f[st - 1][mb]
                        if t < 0.0:
                            break
                        ready = t + send[st - 1]
                    dur = fwd[st]
                else:  # this stage's own forward, and the next stage's backward, then its transfer back
                    ready = done_f[st][mb]
                    if ready < 0.0:
                        break
                    if st < last:
                        t = done_b[st + 1][mb]
                        if t < 0.0:
                            break
                        ready = max(ready, t + send[st])
                    dur = bwd[st]
                start = t_free if t_free > ready else ready
                t_free = start + dur
                (done_f if a.kind == "F" else done_b)[st][mb] = t_free
                out.append((a, start, t_free))
                busy[r] += dur
                i += 1
                remaining -= 1
                progressed = True
            pos[r], free[r] = i, t_free
        if not progressed:
            raise AssertionError(f"{schedule} p={p} m={m} v={v}: the action orders deadlock")
    step = max(free) if free else 0.0
    return Timeline(step, tuple(busy), tuple(tuple(s) for s in spans))


def _simulate_shared(seqs: list[list[Action]], n_stages: int, fwd: list[float], bwd: list[float], send: list[float],
                     speed: list[float]) -> Timeline:
    """``simulate`` with the ranks sharing cores: an action's seconds are its work at the rate every rank computing
    gets, and it progresses at ``speed[k - 1]`` times that while k ranks compute. Event by event: start every action
    whose rank is free and whose input has arrived, then advance to the first action ending or input arriving."""
    p = len(seqs)
    n_mb = 1 + max((a.microbatch for seq in seqs for a in seq), default=0)
    done_f = [[-1.0] * n_mb for _ in range(n_stages)]
    done_b = [[-1.0] * n_mb for _ in range(n_stages)]
    last = n_stages - 1
    pos = [0] * p
    running: list[list | None] = [None] * p  # per rank: [action, start, work left]
    spans: list[list[tuple[Action, float, float]]] = [[] for _ in range(p)]
    busy = [0.0] * p
    t = 0.0
    remaining = sum(len(s) for s in seqs)
    while remaining:
        wake = float("inf")  # the first input still in transit
        for r in range(p):
            if running[r] is not None or pos[r] == len(seqs[r]):
                continue
            a = seqs[r][pos[r]]
            st, mb = a.stage, a.microbatch
            if a.kind == "F":
                ready = 0.0 if st == 0 else (done_f[st - 1][mb] + send[st - 1] if done_f[st - 1][mb] >= 0.0 else -1.0)
            else:
                ready = done_f[st][mb]
                if ready >= 0.0 and st < last:
                    ready = max(ready, done_b[st + 1][mb] + send[st]) if done_b[st + 1][mb] >= 0.0 else -1.0
            if ready < 0.0:
                continue  # its input is not made yet
            if ready > t:
                wake = min(wake, ready)
                continue
            running[r] = [a, t, fwd[st] if a.kind == "F" else bwd[st]]
        active = [r for r in range(p) if running[r] is not None]
        if not active:
            if wake == float("inf"):
                raise AssertionError(f"p={p}: the action orders deadlock")
            t = wake
            continue
        rate = speed[len(active) - 1]
        dt = min(min(running[r][2] for r in active) / rate, wake - t)
        t += dt
        for r in active:
            job = running[r]
            job[2] -= dt * rate
            if job[2] <= 1e-12 * max(1.0, t):
                a, start = job[0], job[1]
                (done_f if a.kind == "F" else done_b)[a.stage][a.microbatch] = t
                spans[r].append((a, start, t))
                busy[r] += t - start
                running[r] = None
                pos[r] += 1
                remaining -= 1
    return Timeline(t, tuple(busy), tuple(tuple(s) for s in spans))


def text_timeline(tl: Timeline, width: int = 100, rank_names: list[str] | None = None) -> str:
    """One row per rank over ``width`` columns spanning the step: a forward of microbatch k as the k-th capital
    letter (A, B, ...), its backward as the lower-case letter, idle as '.'; with more than 26 microbatches a
    forward is '>' and a backward '<'."""
    if tl.step <= 0:
        return ""
    many = max((a.microbatch for spans in tl.spans for a, _, _ in spans), default=0) >= 26
    letters = ">" * 26 if many else "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
    rows = []
    for r, spans in enumerate(tl.spans):
        line = ["."] * width
        for a, s, e in spans:
            c0 = int(s / tl.step * width)
            c1 = max(c0 + 1, int(round(e / tl.step * width)))
            ch = letters[a.microbatch % 26]
            for c in range(c0, min(c1, width)):
                line[c] = ch if a.kind == "F" else ("<" if many else ch.lower())
        name = rank_names[r] if rank_names else f"rank {r}"
        rows.append(f"{name:>8} |{''.join(line)}|")
    return "\n".join(rows)


def png_timeline(tl: Timeline, path: str, title: str = "") -> bool:
    """Draw the timeline as a PNG (forward blue, backward orange, one row per rank); False if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    p = len(tl.spans)
    fig, ax = plt.subplots(figsize=(12, 0.5 + 0.5 * p))
    for r, spans in enumerate(tl.spans):
        for a, s, e in spans:
            ax.barh(r, (e - s) * 1e3, left=s * 1e3, color="#4C72B0" if a.kind == "F" else "#DD8452", edgecolor="white", height=0.8)
            if (e - s) / tl.step > 0.02:
                ax.text((s + e) / 2 * 1e3, r, str(a.microbatch), ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(range(p))
    ax.set_yticklabels([f"rank {r}" for r in range(p)])
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    ax.set_title(title or f"pipeline timeline (bubble {100 * tl.bubble:.1f}%)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
