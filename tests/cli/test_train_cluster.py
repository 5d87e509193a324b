"""``gradwire train --cluster``: 2 workers in network namespaces behind a 100 Mbit/s link.

The bytes the interface really transmitted per extra training step must match what the hook's
own counters say it sent (plus TCP/IP headers and gloo framing). Skips cleanly without root.
"""

from __future__ import annotations

import json

import pytest

from gradwire.cli.train import launch
from gradwire.cluster import cluster_available
from gradwire.harness.training import TrainConfig

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


@pytest.fixture
def cluster_prefix(tmp_path, monkeypatch: pytest.MonkeyPatch):
    """A fresh prefix and a private state folder; the cluster is removed whatever happens."""
    import secrets

    from gradwire.cluster import down, state

    available, why = cluster_available()
    if not available:
        pytest.skip(why)
    monkeypatch.setenv(state.STATE_ENV, str(tmp_path / "state"))
    prefix = "gwt" + secrets.token_hex(3)
    yield prefix
    down(prefix)


def test_train_uses_the_cluster_that_is_up_with_workers_placed_by_node(cluster_prefix: str, tmp_path, capfd) -> None:
    from gradwire.cli.main import main
    from gradwire.cluster import ClusterSpec, up

    up(ClusterSpec(4, workers_per_node=2, bandwidth="100mbit", latency="0", prefix=cluster_prefix))
    # options that contradict the cluster that is up: one line, exit 2, nothing started
    assert main(["train", "--cluster", "--prefix", cluster_prefix, "--bandwidth", "1gbit"]) == 2
    assert capfd.readouterr().err.count("\n") == 1
    summary_path = tmp_path / "s.json"
    assert main(["train", "--cluster", "--prefix", cluster_prefix, "--model", "cnn", "--data", "digits",
                 "--steps", "3", "--batch-size", "16", "--no-eval", "--method", "topk:density=0.01,values=fp16",
                 "--json", str(summary_path), "--timeout", "200"]) == 0
    err = capfd.readouterr().err  # the workers write to the inherited fd 2
    assert f"using the cluster '{cluster_prefix}' that is up" in err and "hostname of the client socket" not in err
    link = json.loads(summary_path.read_text())[0]["link"]
    assert (link["prefix"], link["nodes"], link["workers_per_node"]) == (cluster_prefix, 2, 2)
    assert len(link["tx_bytes"]) == 4 and all(sent > 0 for sent in link["tx_bytes"])
    # what left each node crossed its shaped link; it is part of what the node's workers sent
    for node in range(2):
        sent_by_workers = link["tx_bytes"][2 * node] + link["tx_bytes"][2 * node + 1]
        assert 0 < link["node_tx_bytes"][node] < sent_by_workers
    assert sum(link["node_tx_bytes"]) == pytest.approx(sum(link["node_rx_bytes"]), rel=0.01)
