"""Interleaved zero bubble (the paper's ZB1P with v chunks per rank; torch 2.13's
ScheduleInterleavedZeroBubble): interleaved 1F1B's chunk order with the backward split
into I and W, a one-per-hop warm-up, and rank r deferring its first r W's.

Micro-batches go round in rounds of m / max(1, m // p) (so m must divide into
max(1, m // p) rounds). Loop placement: chunk c of rank r is stage c*p + r.
"""

from __future__ import annotations

from framework.schedules.base import Action, Op, Schedule, Violation, modelled, register
from framework.schedules.zero_bubble import simulated


def _rounds(pp: int, m: int) -> tuple[int, int]:
    rounds = max(1, m // pp)
    return rounds, m // rounds


def _rank(pp: int, m: int, v: int, r: int) -> list[Action]:
    rounds, per_round = _rounds(pp, m)
    warmup = min((v - 1) * per_round + (pp - 1 - r), m * v)
    total = m * v
    f_mb, i_mb, w_mb = [0] * v, [0] * v, [0] * v
    backward_steps: list[int] = []

    def f_chunk(k: int) -> int:
        return (k // per_round) % v

    def b_chunk(k: int) -> int:
        return v - 1 - ((k - warmup) // per_round) % v

    def take(counter: list[int], c: int) -> int:
        counter[c] += 1
        return counter[c] - 1

    acts: list[Action] = []

    def weight() -> None:
        c = b_chunk(backward_steps[sum(w_mb)])
        acts.append(Action(Op.W, take(w_mb, c), c))

    for k in range(total + warmup):
        if k < total:  # warm-up and steady: a forward
            c = f_chunk(k)
            acts.append(Action(Op.F, take(f_mb, c), c))
        if k >= warmup:  # steady and cool-down: a backward input, then a deferred weight
            c = b_chunk(k)
            acts.append(Action(Op.I, take(i_mb, c), c))
            backward_steps.append(k)
            if k - warmup >= r:
                weight()
    while sum(w_mb) < len(backward_steps):
        weight()
    return acts


def interleaved_zb(pp: int, m: int, v: int, steps: int = 1) -> dict[int, list[Action]]:
    return {r: _rank(pp, m, v, r) for r in range(pp)}


def _check(pp: int, m: int, v: int) -> Violation | None:
    rounds, _ = _rounds(pp, m)
    if m % rounds:
        return Violation("schedule.microbatches", f"interleaved-zb sends micro-batches in {rounds} rounds of "
                         f"m // rounds; microbatches={m} does not divide into them",
                         f"use a multiple of pp={pp}, e.g. schedule.microbatches={pp * max(1, m // pp)}")
    return None


register(Schedule(
    name="interleaved-zb", generate=interleaved_zb, ops=frozenset({Op.F, Op.I, Op.W}), min_chunks=2,
    max_chunks=None, preset_chunks=2, constraint=_check,
    doc="interleaved zero bubble (ZB1P, torch's ScheduleInterleavedZeroBubble): v >= 2 chunks, split backward",
    bubble=simulated(interleaved_zb), bubble_source=modelled,
    # warm-up, one more forward, and rank r's r deferred W's: (v-1)*per_round + p
    memory_bound=lambda pp, m, v, r: min((v - 1) * _rounds(pp, m)[1] + pp, m * v)))
