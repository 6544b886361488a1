"""Split backward for zero-bubble schedules: I (the stage input's gradient) now, W (the
weight gradients) later, together computing exactly what one fused backward computes.

How: the autograd graph from the stage output to its input is the "input path". Each
parameter's gradient branches off it at one or more nodes (e.g. a matmul's backward, which
gives both the input's and the weight's gradient). I runs autograd only towards the stage
input, keeps the graph (retain_graph) and records, with a pre-hook, the gradient flowing
into each branching node. W then re-enters the graph at those nodes with the recorded
gradients and runs only the branches that lead to parameters, one parameter group at a
time, accumulating into `.grad` through autograd's own AccumulateGrad. Each node computes
only the outputs its graph task needs, so I + W do the work of B once, with the same
kernels on the same values: bit-equal to B when a stage runs its W's in its I's order
(reordered W's change only the order in which micro-batches' gradients are summed).

The first stage has no input gradient to send: its I does nothing and its W runs the
whole backward. After W the graph is released. With activation checkpointing each of I
and W recomputes the checkpointed forward it needs (non-reentrant checkpointing does so per
backward pass), so recomputation is paid twice.

Torch's pipelining does the same (`_backward.stage_backward_input` /
`stage_backward_weight`); this is a smaller, separate implementation.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch.autograd.graph import GradientEdge, Node


def _node(t: torch.Tensor) -> Optional[Node]:
    """A tensor's grad_fn, or for a leaf its AccumulateGrad (made through a throwaway view)."""
    if t.grad_fn is not None:
        return t.grad_fn
    if not t.requires_grad:
        return None
    return t.view_as(t).grad_fn.next_functions[0][0]


def _consumers(root: Node) -> dict[Node, list[Node]]:
    """Reverse edges of the backward graph below `root`: node -> the nodes feeding it."""
    rev: dict[Node, list[Node]] = defaultdict(list)
    seen, queue = {root}, deque([root])
    while queue:
        n = queue.popleft()
        for nxt, _ in n.next_functions:
            if nxt is not None:
                rev[nxt].append(n)
                if nxt not in seen:
                    seen.add(nxt)
                    queue.append(nxt)
    return rev


def _upstream(starts: list[Node], rev: dict[Node, list[Node]], stop: set[Node]) -> tuple[set[Node], set[Node]]:
    """Nodes from which `starts` are reached (walking towards the output), stopping at
    `stop`: (the nodes walked, the stop nodes met)."""
    walked, met, queue = set(starts), set(), deque(starts)
    while queue:
        for up in rev.get(queue.popleft(), ()):
            if up in stop:
                met.add(up)
            elif up not in walked:
                walked.add(up)
                queue.append(up)
    return walked, met


@dataclass
class _Group:
    params: list[torch.Tensor] = field(default_factory=list)
    nodes: list[Node] = field(default_factory=list)  # where the group's branches leave the input path
    grads: dict = field(default_factory=dict)  # node -> the gradients that flowed into it during I


@dataclass
class PendingWeight:
    """What W needs: the parameter groups with their recorded gradients (split case), or the
    output and its gradient (the first stage's whole backward)."""

    groups: list[_Group]
    output: Optional[torch.Tensor] = None
    grad: Optional[torch.Tensor] = None


def backward_input(output: torch.Tensor, grad: Optional[torch.Tensor], stage_input: Optional[torch.Tensor],
                   params: list[torch.Tensor]) -> tuple[Optional[torch.Tensor], PendingWeight]:
    """I: the stage input's gradient (None on the first stage) and what W will need."""
    if stage_input is None or not stage_input.requires_grad:
        return None, PendingWeight([], output, grad)
    root, x_node = _node(output), _node(stage_input)
    rev = _consumers(root)
    input_path, _ = _upstream([x_node], rev, set())
    groups: dict[Node, _Group] = {}
    for p in params:
        p_node = _node(p)
        if p_node is None or p_node not in rev:
            continue  # not used by this micro-batch's graph
        _, met = _upstream([p_node], rev, input_path)  # not empty: root, on the input path, reaches p
        # parameters whose branches leave at a common node share one W call (a matmul's
        # weight and bias); a node in two groups is simply entered by both, for their own
        # parameters only (`inputs=`), so nothing is counted twice
        shared = next((groups[n] for n in met if n in groups), None) or _Group()
        shared.params.append(p)
        for n in met:
            if n not in shared.nodes:
                shared.nodes.append(n)
            groups[n] = shared
    unique = list({id(g): g for g in groups.values()}.values())
    hooks = [n.register_prehook(_recorder(g, n)) for g in unique for n in g.nodes]
    try:
        (dx,) = torch.autograd.grad(output, stage_input, grad, retain_graph=True)
    finally:
        for h in hooks:
            h.remove()
    return dx, PendingWeight(unique)


def _recorder(group: _Group, node: Node):
    def hook(grad_outputs):
        group.grads[node] = tuple(grad_outputs)
    return hook


def backward_weight(pending: PendingWeight) -> None:
    """W: accumulate every parameter's gradient into `.grad`, then release the graph."""
    if pending.output is not None:
        torch.autograd.backward(pending.output, pending.grad)
        return
    for g in pending.groups:
        edges, grads = [], []
        for n in g.nodes:
            for i, gi in enumerate(g.grads.get(n, ())):
                if gi is not None:
                    edges.append(GradientEdge(n, i))
                    grads.append(gi)
        hooks = []
        if len(g.nodes) > 1:  # a node below another of the group gets only its recorded gradient
            hooks = [n.register_prehook(lambda _, saved=g.grads.get(n): saved) for n in g.nodes]
        try:
            if edges:
                torch.autograd.backward(edges, grads, inputs=g.params, retain_graph=True)
        finally:
            for h in hooks:
                h.remove()
    pending.groups.clear()
