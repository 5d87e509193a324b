"""One training rank, started by ``gradwire train``'s launcher: ``python -m gradwire.cli.worker CONFIG RESULT``.

Reads the TrainConfig JSON at CONFIG; rendezvous through the usual torch.distributed variables
(MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE); rank 0 writes the summaries to RESULT as JSON.
"""

from __future__ import annotations

import datetime
import json
import os
import sys

import torch
import torch.distributed as dist


def main(argv: list[str]) -> int:
    config_path, result_path = argv
    from ..training import TrainConfig, run_rank

    with open(config_path) as handle:
        config = TrainConfig(**json.load(handle))
    torch.set_num_threads(config.threads)
    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0"))) % torch.cuda.device_count())
    timeout = datetime.timedelta(seconds=float(os.environ.get("GRADWIRE_PG_TIMEOUT", "300")))
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timeout)
    try:
        summaries = run_rank(config)
        if dist.get_rank() == 0:
            with open(result_path, "w") as handle:
                json.dump(summaries, handle, default=str)
        dist.barrier()  # nobody tears down its gloo pairs while a peer still uses them
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
