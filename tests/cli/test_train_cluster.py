"""``gradwire train --cluster``: 2 workers in network namespaces behind a 100 Mbit/s link.

The bytes the interface really transmitted per extra training step must match what the hook's
own counters say it sent (plus TCP/IP headers and gloo framing). Skips cleanly without root.
"""

from __future__ import annotations

import pytest

from gradwire.cli.train import launch
from gradwire.cluster import cluster_available
from gradwire.training import TrainConfig

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]


def _run(method: str, steps: int) -> dict:
    config = TrainConfig(methods=[method], model="cnn", data="digits", epochs=1, steps_per_epoch=steps,
                         batch_size=16, evaluate=False, progress=False)
    return launch(config, 2, timeout=200, cluster=("100mbit", "0"))[0]


def test_wire_bytes_match_hook_stats_across_a_rate_limited_link() -> None:
    available, why = cluster_available()
    if not available:
        pytest.skip(why)
    method = "topk:density=0.01,values=fp16,indices=rice"
    short, long = _run(method, 2), _run(method, 7)
    assert short["status"] == long["status"] == "ok"
    # rank 1 sends only its payloads and the lengths (rank 0 also broadcasts BatchNorm buffers)
    wire_per_step = (long["link"]["launch_bytes_sent_by_rank"][1] - short["link"]["launch_bytes_sent_by_rank"][1]) / 5
    hook_per_step = long["bytes_per_step"]
    dense_per_step = 2 * (2 - 1) / 2 * 4 * long["parameters"]
    assert 0 < hook_per_step < dense_per_step / 20
    assert hook_per_step <= wire_per_step <= 1.5 * hook_per_step + 4096, (wire_per_step, hook_per_step)
