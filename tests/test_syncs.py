"""The step's host-device sync points (framework/device.py: `wait` and `to_host`, the one helper
every one goes through, counted on every device) do not grow with layers or micro-batches,
for dp, tp + SP, pp, cp and ep layouts (issue 46, item 2). The one read an algorithm needs
per layer, MoE routing's splits, is one per MoE layer's forward, and nothing else is.

Each layout runs twice, 2 blocks x 2 micro-batches and 4 x 4, and every rank's
`rank_host_syncs` (metrics.jsonl) of the last step is compared."""

import pytest

from .conftest import TINY, read_metrics, run_local

LAYOUTS = {"dp2_tp2_sp": ["parallelism=single", "parallelism.dp=2", "parallelism.tp=2",
                          "parallelism.sequence_parallel=true"],
           "pp2_cp2_ring": ["parallelism=pp2", "schedule=flush", "parallelism.cp=2", "parallelism.cp_comm=ring"],
           "ep2_pp2": ["parallelism=pp2", "schedule=flush", "model=moe-tiny", "parallelism.dp=2", "parallelism.ep=2"]}
SIZES = ((2, 2), (4, 4))  # (blocks, micro-batches)
PP = {"dp2_tp2_sp": 1, "pp2_cp2_ring": 2, "ep2_pp2": 2}


def _syncs(tmp_path, name: str, layers: int, m: int) -> list[dict]:
    job = tmp_path / f"{name}_{layers}x{m}"
    run_local(job, *TINY, "data=synthetic", "trainer.steps=2", f"model.n_layer={layers}",
              f"schedule.microbatches={m}", *LAYOUTS[name])
    return read_metrics(job)[-1]["rank_host_syncs"]


@pytest.mark.parametrize("name", LAYOUTS)
def test_sync_points_do_not_grow_with_layers_or_microbatches(tmp_path, name):
    small, large = (_syncs(tmp_path, name, n, m) for n, m in SIZES)
    assert len(small) == len(large) > 1
    for rank, (a, b) in enumerate(zip(small, large, strict=True)):
        routing = [r.pop("moe routing", 0) for r in (a, b)]
        assert a == b, (rank, a, b)
        assert sum(a.values()) <= 6, a  # the clock's start and end, the loss and norm, once-a-step statistics
        if name.startswith("ep"):  # one read per MoE layer's forward: the layers on this stage x micro-batches
            assert routing == [n // PP[name] * m for n, m in SIZES], (rank, routing)
        else:
            assert routing == [0, 0]
