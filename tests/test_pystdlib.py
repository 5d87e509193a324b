"""The pystdlib corpus: a fixed file order, whole-file splits that never overlap, a stable fingerprint."""

from __future__ import annotations

import time

import pytest
import torch

from gradwire.harness import pystdlib as corpus
from gradwire.harness.pystdlib import is_held_out, pystdlib, stdlib_files
from gradwire.harness.workloads import ByteWindows, build_workload, parse_data


def _write(root, relative: str, text: str) -> None:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text.encode())


def test_files_are_sorted_and_skipped_directories_are_never_read(tmp_path) -> None:
    for relative in ("b.py", "a/z.py", "a/b.py", "site-packages/pkg.py", "test/test_x.py", "lib2to3/tests/t.py",
                     "idlelib/idle_test/t.py", "encodings/cp1.py", "pydoc_data/topics.py", "notes.txt", "A.py"):
        _write(tmp_path, relative, relative)
    assert stdlib_files(str(tmp_path)) == ["A.py", "a/b.py", "a/z.py", "b.py"]


def test_splits_are_whole_files_in_order_disjoint_and_cut_at_their_sizes(tmp_path) -> None:
    names = [f"m{i:02d}.py" for i in range(40)]
    for name in names:
        _write(tmp_path, name, f"# {name}\n" + name * 50 + "\n")
    text = pystdlib.__wrapped__(max_bytes=3000, held_out_bytes=1000, held_out_every=4, root=str(tmp_path))
    held = [name for name in names if is_held_out(name, 4)]
    assert 4 <= len(held) <= 20  # ~1 in 4 by the hash
    assert set(text.held_out_files) <= set(held) and not set(text.train_files) & set(held)
    assert list(text.held_out_files) == held[:len(text.held_out_files)]  # the fixed order
    assert text.train_files == tuple(n for n in names if n not in held)[:len(text.train_files)]
    expected_held = b"".join((tmp_path / n).read_bytes() for n in text.held_out_files)[:1000]
    expected_train = b"".join((tmp_path / n).read_bytes() for n in text.train_files)[:3000]
    assert bytes(text.held_out.tolist()) == expected_held and bytes(text.train.tolist()) == expected_train
    assert text.train.dtype == torch.uint8 and (text.train.numel(), text.held_out.numel()) == (3000, 1000)
    with pytest.raises(ValueError, match="hold only"):
        pystdlib.__wrapped__(held_out_bytes=10 ** 7, held_out_every=4, root=str(tmp_path))
    with pytest.raises(ValueError, match="held_out_every=1 must be an integer >= 2"):
        pystdlib.__wrapped__(held_out_every=1, root=str(tmp_path))


def test_the_real_library_loads_fast_deterministically_and_never_overlaps() -> None:
    started = time.perf_counter()
    first = pystdlib.__wrapped__()  # not the cached one: read the files again
    assert time.perf_counter() - started < 2.0
    second = pystdlib.__wrapped__()
    assert first.fingerprint == second.fingerprint and torch.equal(first.train, second.train)
    assert first.fingerprint.startswith(f"pystdlib-py{first.python_version}-")
    assert len(first.fingerprint.split("-")[-1]) == 16
    assert (first.train.numel(), first.held_out.numel()) == (corpus.DEFAULT_MAX_BYTES, corpus.DEFAULT_HELD_OUT_BYTES)
    assert not set(first.train_files) & set(first.held_out_files) and len(first.held_out_files) >= 5
    assert not any(part in corpus.SKIPPED_DIRS for path in first.train_files for part in path.split("/")[:-1])
    # no file is in both splits, but the library repeats itself (boilerplate, code shared by
    # cProfile.py and profile.py, ...): ~4% of held-out 128-byte chunks occur verbatim in training
    # on CPython 3.11; an overlapping split would put ~100% there
    train, held = first.train.numpy().tobytes(), first.held_out.numpy().tobytes()
    offsets = range(0, len(held) - 128, 1024)
    assert sum(train.find(held[offset: offset + 128]) >= 0 for offset in offsets) < 0.1 * len(offsets)
    other = pystdlib.__wrapped__(max_bytes=1 << 20, held_out_bytes=1 << 16)
    assert other.fingerprint != first.fingerprint  # the fingerprint covers the sizes
    assert first.info()["fingerprint"] == first.fingerprint and first.info()["train_bytes"] == 8 * 1024 * 1024


def test_the_lm_workload_windows_every_next_byte_and_evaluates_the_whole_held_out_split() -> None:
    workload = build_workload("gpt", "pystdlib:max_bytes=65536,held_out_bytes=8192",
                              model_options={"d_model": 16, "n_layers": 1, "n_heads": 2, "d_ff": 32})
    text = pystdlib(max_bytes=65536, held_out_bytes=8192)
    assert workload.metric == "loss" and workload.info["fingerprint"] == text.fingerprint
    assert (len(workload.train), len(workload.test)) == (65535 // 128, 8191 // 128)
    inputs, targets = workload.test[3]
    assert inputs.dtype == torch.int64 and inputs.shape == (128,)
    assert torch.equal(inputs, text.held_out[384:512].long()) and torch.equal(targets, text.held_out[385:513].long())
    windows = ByteWindows(torch.arange(10, dtype=torch.uint8), 4)
    assert len(windows) == 2 and windows[1][1].tolist() == [5, 6, 7, 8]


@pytest.mark.parametrize("data, message", [
    ("pystdlib:colour=1", "'colour=1' is not an option; allowed: max_bytes=N"),
    ("pystdlib:max_bytes=lots", "max_bytes='lots' is not an integer"),
    ("synthetic:max_bytes=1", "synthetic takes no options"),
])
def test_bad_data_options_name_the_problem(data: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_data(data)
