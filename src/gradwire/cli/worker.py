"""One training rank, started by ``gradwire train``'s launcher: ``python -m gradwire.cli.worker CONFIG RESULT``.

Reads the TrainConfig JSON at CONFIG; rendezvous through the usual torch.distributed variables
(RANK, WORLD_SIZE, and MASTER_ADDR/MASTER_PORT or GRADWIRE_INIT_METHOD, e.g. ``file://...`` for a
local run, which opens no listening socket); rank 0 rewrites the summaries so far to RESULT as
JSON after every method, so the launcher can save them as they come.

It dies with its launcher: Linux sends it SIGKILL when the launcher's thread that started it
exits (``prctl(PR_SET_PDEATHSIG)``, set by the launcher between fork and exec), so even a
SIGKILLed launcher leaves no worker behind.
"""

from __future__ import annotations

import datetime
import json
import os
import sys

import torch
import torch.distributed as dist

from ..lifetime import barrier


def _write_atomically(path: str, summaries: list) -> None:
    """Write then rename, so the launcher never reads half a file."""
    partial = f"{path}.partial"
    with open(partial, "w") as handle:
        json.dump(summaries, handle, default=str)
    os.replace(partial, path)


def main(argv: list[str]) -> int:
    """Run this rank's methods (module docstring); returns 0.

    Args:
        argv: ``[CONFIG, RESULT]``: the TrainConfig JSON to read and the file rank 0 rewrites.

    Raises:
        KeyError: ``RANK`` or ``WORLD_SIZE`` is not set.
    """
    config_path, result_path = argv
    from ..harness.training import TrainConfig, run_rank

    with open(config_path) as handle:
        config = TrainConfig(**json.load(handle))
    torch.set_num_threads(config.threads)
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= local_world_size
    if use_cuda:
        local_rank = int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")))
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    timeout = datetime.timedelta(seconds=float(os.environ.get("GRADWIRE_PG_TIMEOUT", "300")))
    init_method = os.environ.get("GRADWIRE_INIT_METHOD", "env://")
    dist.init_process_group("nccl" if use_cuda else "gloo", init_method=init_method, timeout=timeout,
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    try:
        def save(summaries: list) -> None:
            if dist.get_rank() == 0:
                _write_atomically(result_path, summaries)

        run_rank(config, on_summary=save)
        barrier()  # nobody tears down its gloo pairs while a peer still uses them
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    # PyTorch itself can abort at interpreter exit after gloo collectives and
    # destroy_process_group (pytorch PR #179291): results are written, so leave without teardown
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
