"""The emulated cluster: spec validation, namespace lifecycle, reachability, real rate limits, gloo.

Tests that build namespaces need root and iproute2 and skip with the reason otherwise. Each uses
its own random prefix and a finalizer that deletes that prefix's namespaces whatever happens, and
every subprocess is killed at the end of its test. Traffic goes only between the 10.231.0.x
addresses inside the test's own namespaces (which have no route anywhere else).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

from gradwire.cluster import (
    Cluster, ClusterError, ClusterExistsError, ClusterSpec, cluster_available, command, down, netns, status, up,
)
from gradwire.cluster import state
from gradwire.cluster.netns import NETNS_ETC, list_namespaces, tbf_parameters

PROBE = str(Path(__file__).with_name("probe.py"))
SLOW, FAST = "100mbit", "10gbit"


@pytest.fixture(autouse=True)
def private_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """State files of this test's clusters go to its own folder: `down_all` never sees others'."""
    folder = tmp_path / "cluster-state"
    monkeypatch.setenv(state.STATE_ENV, str(folder))
    return folder


@pytest.fixture
def prefix(request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh prefix ("gwt" + 6 hex digits); its namespaces are deleted after the test, pass or fail."""
    ok, why = cluster_available()
    if not ok:
        pytest.skip(why)
    name = "gwt" + secrets.token_hex(3)
    yield name
    down(name)
    assert list_namespaces(name) == [], f"namespaces left behind: {list_namespaces(name)}"


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen]]:
    """Subprocesses started by a test; any still running at the end are killed."""
    started: list[subprocess.Popen] = []
    yield started
    for process in started:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=10)


def start(processes: list[subprocess.Popen], argv: list[str], **kwargs) -> subprocess.Popen:
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)
    processes.append(process)
    return process


def transfer(cluster: Cluster, processes: list, sender: int, receiver: int, nbytes: int, port: int = 5001) -> dict:
    """Send ``nbytes`` over TCP from rank ``sender`` to rank ``receiver``; the receiver's {"bytes", "seconds"}."""
    host = cluster.addresses[receiver]
    listener = start(processes, cluster.wrap(receiver, [sys.executable, PROBE, "recv", host, str(port)]))
    assert listener.stdout.readline().strip() == "listening", listener.stderr.read()
    subprocess.run(cluster.wrap(sender, [sys.executable, PROBE, "send", host, str(port), str(nbytes)]),
                   check=True, capture_output=True, timeout=60)
    out, err = listener.communicate(timeout=30)
    assert listener.returncode == 0, err
    return json.loads(out)


# ------------------------------------------------------------------------- no root needed


@pytest.mark.parametrize("kwargs, option", [
    ({"workers": 0}, "workers"), ({"workers": 65}, "workers"), ({"workers": 2.0}, "workers"),
    ({"bandwidth": "100"}, "bandwidth"), ({"bandwidth": "100mbps"}, "bandwidth"), ({"bandwidth": "1kbit"}, "bandwidth"),
    ({"latency": "5"}, "latency"), ({"latency": "1s"}, "latency"), ({"latency": "-1ms"}, "latency"),
    ({"prefix": "GW"}, "prefix"), ({"prefix": "gw-x"}, "prefix"), ({"prefix": "abcdefghijk"}, "prefix"),
    ({"workers": 4, "workers_per_node": 3}, "workers_per_node"), ({"workers_per_node": 0}, "workers_per_node"),
    ({"workers_per_node": 4}, "workers_per_node"),
])
def test_spec_rejects_bad_values_naming_the_option(kwargs: dict, option: str) -> None:
    with pytest.raises(ValueError, match=rf"^{option}=.*allowed"):
        ClusterSpec(**{"workers": 2, **kwargs})


def test_spec_parses_units() -> None:
    spec = ClusterSpec(4, bandwidth="2.5gbit", latency="500us")
    assert (spec.rate_bits, spec.latency_us) == (2_500_000_000, 500.0)
    assert ClusterSpec(1, bandwidth="100mbit", latency="0.5ms").latency_us == 500.0
    assert ClusterSpec(1, latency="0").latency_us == 0.0
    # the bucket must hold one GSO super-packet, and 4 ms at high rates (else tbf caps below the rate)
    assert tbf_parameters(100_000_000)["burst"] >= 64 * 1024
    assert tbf_parameters(10_000_000_000)["burst"] >= 10_000_000_000 / 8 / 250


def test_cluster_names_without_building_anything() -> None:
    cluster = Cluster(ClusterSpec(3, prefix="gwx"), latency_emulated=False)
    assert cluster.namespaces == ["gwx-w0", "gwx-w1", "gwx-w2"]
    assert cluster.addresses == ["10.231.0.1", "10.231.0.2", "10.231.0.3"]
    assert cluster.master_addr == "10.231.0.1"
    assert cluster.interface(2) == "eth0"
    wrapped = cluster.wrap(1, ["python", "-V"])
    assert Path(wrapped[0]).name == "ip" and wrapped[1:] == ["netns", "exec", "gwx-w1", "python", "-V"]
    with pytest.raises(ValueError, match="rank"):
        cluster.wrap(3, ["true"])
    nodes = Cluster(ClusterSpec(6, workers_per_node=3, prefix="gwx"), latency_emulated=False)
    assert nodes.spec.nodes == 2 and [nodes.node_of(r) for r in range(6)] == [0, 0, 0, 1, 1, 1]
    assert nodes.node_namespaces == ["gwx-n0", "gwx-n1"] and cluster.node_namespaces == []


# ------------------------------------------------------------------------- root needed


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_up_down_creates_and_removes_exactly_its_namespaces(prefix: str) -> None:
    before = set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout.split())
    with up(ClusterSpec(3, bandwidth=SLOW, latency="0", prefix=prefix)) as cluster:
        assert list_namespaces(prefix) == [f"{prefix}-hub", *cluster.namespaces]
        report = status(prefix)
        assert report["addresses"][f"{prefix}-w2"] == ["10.231.0.3/24"]
        for namespace in cluster.namespaces:  # uplink shaped
            assert any("tbf" in line and "eth0" in line for line in report["qdiscs"][namespace])
        assert sum("tbf" in line for line in report["qdiscs"][f"{prefix}-hub"]) == 3  # downlinks shaped
        for namespace in cluster.namespaces:  # no default route: nothing can leave the subnet
            routes = subprocess.run(["ip", "-n", namespace, "route", "show"], capture_output=True, text=True,
                                    check=True).stdout.splitlines()
            assert [route.split()[0] for route in routes] == ["10.231.0.0/24"]
        with pytest.raises(ClusterExistsError, match="gradwire cluster down"):
            up(ClusterSpec(1, prefix=prefix))
    after = set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout.split())
    assert list_namespaces(prefix) == [] and after - before == set()
    assert down(prefix) == []  # safe when nothing exists


@pytest.mark.distributed
@pytest.mark.timeout(60)
@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_body_raising_still_tears_down(prefix: str, error: type[BaseException]) -> None:
    with pytest.raises(error):
        with up(ClusterSpec(2, latency="0", prefix=prefix)):
            assert len(list_namespaces(prefix)) == 3
            raise error("boom")
    assert list_namespaces(prefix) == []


@pytest.mark.distributed
@pytest.mark.timeout(60)
@pytest.mark.parametrize("error", [ClusterError, KeyboardInterrupt])
def test_failure_half_way_through_up_leaves_nothing(prefix: str, error: type[BaseException],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def failing_shape(*args: object) -> None:
        calls.append(args)
        if len(calls) == 3:  # rank 1's uplink: rank 0 complete, rank 1's namespace and veth exist
            raise error("injected")

    monkeypatch.setattr(netns, "_shape", failing_shape)
    with pytest.raises(error, match="injected"):
        up(ClusterSpec(3, latency="0", prefix=prefix))
    assert list_namespaces(prefix) == []


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_workers_reach_each_other_both_ways(prefix: str, processes: list) -> None:
    with up(ClusterSpec(2, bandwidth=FAST, latency="0", prefix=prefix)) as cluster:
        assert transfer(cluster, processes, 0, 1, 100_000)["bytes"] == 100_000
        assert transfer(cluster, processes, 1, 0, 100_000, port=5002)["bytes"] == 100_000


@pytest.mark.distributed
@pytest.mark.timeout(90)
def test_rate_limit_is_real(prefix: str, processes: list) -> None:
    nbytes = 4_000_000
    with up(ClusterSpec(2, bandwidth=SLOW, latency="0", prefix=prefix)) as cluster:
        slow = transfer(cluster, processes, 0, 1, nbytes)
    theory = nbytes * 8 / 100e6  # 0.32 s; tbf also counts headers, so real transfers take ~5 % longer
    assert slow["bytes"] == nbytes and slow["seconds"] >= 0.8 * theory, slow
    with up(ClusterSpec(2, bandwidth=FAST, latency="0", prefix=prefix)) as cluster:
        fast = transfer(cluster, processes, 0, 1, nbytes)
    assert fast["seconds"] < 0.5 * slow["seconds"], (fast, slow)


@pytest.mark.distributed
@pytest.mark.timeout(90)
def test_downlink_is_shaped_too(prefix: str, processes: list) -> None:
    """Two senders into one receiver share its downlink (shaped on the hub side), not 2x the rate."""
    nbytes = 3_000_000
    with up(ClusterSpec(3, bandwidth=SLOW, latency="0", prefix=prefix)) as cluster:
        host = cluster.addresses[2]
        listeners = [start(processes, cluster.wrap(2, [sys.executable, PROBE, "recv", host, str(port)]))
                     for port in (5001, 5002)]
        for listener in listeners:
            assert listener.stdout.readline().strip() == "listening"
        senders = [start(processes, cluster.wrap(rank, [sys.executable, PROBE, "send", host, str(port), str(nbytes)]))
                   for rank, port in ((0, 5001), (1, 5002))]
        for process in senders + listeners:
            assert process.wait(timeout=60) == 0, process.stderr.read()
        flows = [json.loads(listener.stdout.readline()) for listener in listeners]
    # from the first flow's start to the last one's end, both crossed one 100 Mbit/s downlink
    # (each sender's uplink alone would allow 2x that); staggered starts only lengthen this span
    span = max(flow["end"] for flow in flows) - min(flow["start"] for flow in flows)
    assert sum(flow["bytes"] for flow in flows) * 8 / span <= 1.2 * 100e6, flows


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_gloo_all_reduce_across_namespaces_takes_the_bandwidth_time(prefix: str, processes: list) -> None:
    numel, world_size = 2_500_000, 2
    with up(ClusterSpec(world_size, bandwidth=SLOW, latency="0", prefix=prefix)) as cluster:
        ranks = []
        for rank in range(world_size):
            # gloo picks its interface from the hostname, which resolves to nothing inside the
            # namespace, so it falls back to lo and peers cannot connect: name the interface
            env = dict(os.environ, MASTER_ADDR=cluster.master_addr, MASTER_PORT="29500", RANK=str(rank),
                       WORLD_SIZE=str(world_size), GLOO_SOCKET_IFNAME=cluster.interface(rank), OMP_NUM_THREADS="1")
            command = cluster.wrap(rank, [sys.executable, PROBE, "allreduce", str(numel)])
            ranks.append(start(processes, command, env=env))
        results = []
        for process in ranks:
            out, err = process.communicate(timeout=100)
            assert process.returncode == 0, err[-3000:]
            results.append(json.loads(out.strip().splitlines()[-1]))
    assert all(result["correct"] for result in results), results
    # a ring all-reduce sends 2(p-1)/p x N x 4 bytes per worker over its 100 Mbit/s uplink
    theory = 2 * (world_size - 1) / world_size * numel * 4 * 8 / 100e6  # 0.8 s
    assert min(result["seconds"] for result in results) >= 0.8 * theory, results


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_command_up_status_down(prefix: str, capsys: pytest.CaptureFixture) -> None:
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    assert command.run(parser.parse_args(["up", "--workers", "2", "--bandwidth", SLOW, "--prefix", prefix])) == 0
    assert f"ip netns exec {prefix}-w0" in capsys.readouterr().out
    assert command.run(parser.parse_args(["up", "--prefix", prefix])) == 1  # exists already
    assert "gradwire cluster down" in capsys.readouterr().err
    assert command.run(parser.parse_args(["status", "--json", "--prefix", prefix])) == 0
    assert json.loads(capsys.readouterr().out)["namespaces"] == [f"{prefix}-hub", f"{prefix}-w0", f"{prefix}-w1"]
    assert command.run(parser.parse_args(["down", "--prefix", prefix])) == 0
    assert list_namespaces(prefix) == []
    assert command.run(parser.parse_args(["up", "--bandwidth", "fast", "--prefix", prefix])) == 2
    assert "bandwidth='fast'" in capsys.readouterr().err


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_nodes_shape_only_cross_node_traffic_and_count_it(prefix: str, processes: list) -> None:
    """2 nodes x 2 workers at 100 Mbit/s: in-node transfers do not touch the shaped link (fast, not
    counted on the node's uplink), cross-node ones cross it (rate-limited, counted)."""
    nbytes = 4_000_000
    theory = nbytes * 8 / 100e6  # 0.32 s at the node link's rate
    with up(ClusterSpec(4, workers_per_node=2, bandwidth=SLOW, latency="0", prefix=prefix)) as cluster:
        report = status(prefix)
        assert all(not report["qdiscs"][namespace] for namespace in cluster.namespaces)  # workers unshaped
        assert any(f"{prefix}-u0" in line and "tbf" in line for line in report["qdiscs"][f"{prefix}-n0"])
        assert sum("tbf" in line for line in report["qdiscs"][f"{prefix}-hub"]) == 2  # node downlinks
        before = cluster.counters()
        inside = transfer(cluster, processes, 0, 1, nbytes)
        middle = cluster.counters()
        across = transfer(cluster, processes, 1, 2, nbytes, port=5002)
        after = cluster.counters()
    assert inside["bytes"] == across["bytes"] == nbytes
    assert inside["seconds"] < 0.5 * theory, inside
    assert across["seconds"] >= 0.8 * theory, across
    # rank 0 -> 1 stays in node 0: its eth0 counts the bytes, node 0's uplink (almost) nothing (ARP)
    assert middle["tx_bytes"][0] - before["tx_bytes"][0] >= nbytes
    assert middle["node_tx_bytes"][0] - before["node_tx_bytes"][0] < 0.01 * nbytes
    # rank 1 -> 2 leaves node 0 through its uplink and enters node 1 through its downlink
    assert after["node_tx_bytes"][0] - middle["node_tx_bytes"][0] >= nbytes
    assert after["node_rx_bytes"][1] - middle["node_rx_bytes"][1] >= nbytes


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_up_records_state_and_down_removes_host_files(prefix: str, private_state: Path) -> None:
    with up(ClusterSpec(2, latency="0", prefix=prefix)):
        record = json.loads((private_state / f"{prefix}.json").read_text())
        assert record["namespaces"] == [f"{prefix}-hub", f"{prefix}-w0", f"{prefix}-w1"] and record["owner"] is None
        hosts = Path(NETNS_ETC, f"{prefix}-w0", "hosts").read_text()
        assert f"::ffff:10.231.0.2 {prefix}-w1" in hosts  # c10d sees peers as IPv4-mapped addresses
        # a peer's name resolves inside the namespace (no "hostname cannot be retrieved" from c10d)
        named = subprocess.run(["ip", "netns", "exec", f"{prefix}-w0", sys.executable, "-c",
                                "import socket; print(socket.getnameinfo(('::ffff:10.231.0.2', 1, 0, 0), 0)[0])"],
                               capture_output=True, text=True, timeout=30)
        assert named.stdout.strip() == f"{prefix}-w1", named.stderr
    assert not (private_state / f"{prefix}.json").exists()
    assert not Path(NETNS_ETC, f"{prefix}-w0").exists()


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_command_nodes_prefix_first_and_down_without_arguments(prefix: str, capsys: pytest.CaptureFixture) -> None:
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    argv = ["up", "--nodes", "2", "--workers-per-node", "2", "--bandwidth", SLOW, "--latency", "0", "--prefix", prefix]
    assert command.run(parser.parse_args(argv)) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith(f"cluster '{prefix}' is up: 2 nodes x 2 workers"), first
    assert list_namespaces(prefix) == [f"{prefix}-hub", f"{prefix}-n0", f"{prefix}-n1",
                                       *(f"{prefix}-w{r}" for r in range(4))]
    assert command.run(parser.parse_args(["down"])) == 0
    assert f"{prefix}-hub" in capsys.readouterr().out
    assert list_namespaces(prefix) == []
    assert command.run(parser.parse_args(["up", "--nodes", "2", "--workers", "3", "--prefix", prefix])) == 2
    assert capsys.readouterr().err.count("\n") == 1


def _alive(pid: int) -> bool:
    return state.process_start_time(pid) is not None


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_sigkill_of_the_launcher_then_down_leaves_nothing(private_state: Path, processes: list) -> None:
    """SIGKILL `gradwire train --cluster`: its workers die with it (parent-death signal), and
    `gradwire cluster down` with no arguments removes its namespaces, host files, temp folder."""
    ok, why = cluster_available()
    if not ok:
        pytest.skip(why)
    env = dict(os.environ, **{state.STATE_ENV: str(private_state)})
    launcher = subprocess.Popen([sys.executable, "-m", "gradwire", "train", "--cluster", "--workers", "2",
                                 "--data", "digits", "--epochs", "50", "--no-eval", "--method", "allreduce",
                                 "--latency", "0", "--prefix", "gwnotup"],
                                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    processes.append(launcher)
    record: dict = {}
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline and launcher.poll() is None:
            records = state.read_all()
            if records:
                record = records[0]
                workers = [int(pid) for namespace in record["namespaces"][1:] if namespace in list_namespaces(
                    record["prefix"]) for pid in subprocess.run(["ip", "netns", "pids", namespace],
                                                                 capture_output=True, text=True).stdout.split()]
                if len(workers) == 2:
                    break
            time.sleep(0.5)
        assert len(workers) == 2, f"workers did not start: {record}"
        temp_dir = record["temp_dir"]
        assert os.path.isdir(temp_dir)
        launcher.kill()
        launcher.wait(timeout=30)
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(pid) for pid in workers), "workers outlived a SIGKILLed launcher"
        assert list_namespaces(record["prefix"]), "the killed launcher left nothing to clean: test is void"
        done = subprocess.run([sys.executable, "-m", "gradwire", "cluster", "down"], env=env, capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 0 and record["prefix"] in done.stdout, done
        assert list_namespaces(record["prefix"]) == []
        assert not any(os.path.exists(folder) for folder in record["etc_folders"])
        assert not os.path.exists(temp_dir) and state.read_all() == []
        links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
        assert f"{record['prefix']}-" not in links  # no veth end in the host's namespace either
    finally:
        for pid in workers:
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        if record:
            down(record["prefix"])
