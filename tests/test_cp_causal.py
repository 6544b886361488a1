"""Context parallelism computes causal work only (issue 47): each cp rank's attention, run
in this process with its peers' K / V served from a table (the ring's passes, the
all-gather, Ulysses' all-to-alls), multiplies exactly the causal count of query x key
scores, chunk by chunk (the sequence is 2 cp chunks of c tokens: chunk i sees chunks 0..i,
so 2 cp (2 cp + 1) / 2 chunk pairs of c^2 scores, the diagonal ones under a causal mask),
not the whole T x T rectangle, and the ring's and the all-gather's outputs equal full causal
attention over the whole sequence in fp64. The multi-rank runs (test_context_parallel.py)
check the training against the single process."""

from types import SimpleNamespace

import pytest
import torch

from framework.parallel import context_parallel as cpm
from framework.parallel import ring_attention as ring
from framework.parallel import ulysses
from framework.comm.tp_comm import TPComm

B, H, KV, D = 2, 8, 4, 8


def _reference(q, k, v, scaling):
    k, v = (t.repeat_interleave(q.size(1) // k.size(1), dim=1) for t in (k, v))
    T = q.size(2)
    scores = (q @ k.transpose(-1, -2)) * scaling
    scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2)  # (B, T, heads, d)


def _ranks(monkeypatch, method, cp, balance, T):
    """Every cp rank's attention on its tokens of one (q, k, v); returns (outputs in sequence
    order, the summed score count, the reference)."""
    torch.manual_seed(0)
    q = torch.randn(B, H, T, D, dtype=torch.float64)
    k, v = (torch.randn(B, KV, T, D, dtype=torch.float64) for _ in range(2))
    contexts = [cpm.ContextParallel(TPComm(None, cp, r), T, balance, torch.device("cpu"), method, ranks=list(range(cp)))
                for r in range(cp)]
    local = [(q[:, :, c.index], k[:, :, c.index], v[:, :, c.index]) for c in contexts]
    me = {}

    def batch(ops):  # the ring: pass s brings cp rank (r - s)'s K / V block
        (_, _, _, _), (_, out, _, _) = ops
        me["s"] += 1
        j = (me["r"] - me["s"]) % cp
        out.copy_(torch.cat([local[j][1], local[j][2]], dim=-1))
        return [SimpleNamespace(wait=lambda timeout=None: True)]

    def gather(t, comm, dim):  # the all-gather: every rank's K or V, rank order
        which = 1 if t is local[me["r"]][1] else 2
        return torch.cat([local[j][which] for j in range(cp)], dim=dim)

    monkeypatch.setattr(ring, "dist", SimpleNamespace(isend="isend", irecv="irecv", batch_isend_irecv=batch,
                                                      P2POp=lambda op, t, peer, group: (op, t, peer, group)))
    monkeypatch.setattr(cpm, "gather_from_sequence_parallel_region", gather)
    monkeypatch.setattr(ulysses, "all_to_all", lambda cp_, x, heads_to_sequence: (
        x.reshape(x.size(0), x.size(1) // cp, x.size(2) * cp, x.size(3)) if heads_to_sequence else
        x.reshape(x.size(0), x.size(1) * cp, x.size(2) // cp, x.size(3))))  # shapes only: the count
    module = SimpleNamespace(training=False)
    outs = []
    for r, c in enumerate(contexts):
        me.update(r=r, s=0)
        outs.append(cpm._core(c, module, *local[r], 0.0, D ** -0.5))
    full = torch.empty(B, T, H, D, dtype=torch.float64)
    for c, out in zip(contexts, outs):
        full[:, c.index] = out
    return full, sum(c.score_elements for c in contexts), _reference(q, k, v, D ** -0.5)


@pytest.mark.parametrize("method", ["ring", "allgather", "a2a"])
@pytest.mark.parametrize("cp, balance", [(2, "headtail"), (4, "headtail"), (4, "contiguous")])
def test_cp_multiplies_the_causal_count_and_equals_causal_attention(monkeypatch, method, cp, balance):
    T = 16 * cp
    c = T // (2 * cp)
    out, scores, want = _ranks(monkeypatch, method, cp, balance, T)
    causal = B * H * c * c * (2 * cp) * (2 * cp + 1) // 2
    assert scores == causal  # cp 4: 36 chunk pairs of the 64 the whole rectangle multiplied; cp 2: 10 of 16
    if method != "a2a":  # Ulysses' all-to-all is faked by shape here; its values: the multi-rank runs
        torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)


def test_a_block_part_is_the_keys_at_or_before_the_query_chunk():
    """ContextParallel.parts at cp 2, head-tail (rank 0 holds chunks 0 and 3, rank 1 chunks 1
    and 2; c = 4 tokens): rank 0's own block is causal for both its chunks (chunk 3 sees its
    chunk 0 whole); rank 1's block is skipped by chunk 0 and wholly past for chunk 3."""
    parts = [cpm.ContextParallel(TPComm(None, 2, r), 16, "headtail", torch.device("cpu"), "ring").parts for r in (0, 1)]
    assert parts[0] == [[(4, True), (8, True)], [None, (8, False)]]
    assert parts[1] == [[(4, False), (4, False)], [(4, True), (8, True)]]
