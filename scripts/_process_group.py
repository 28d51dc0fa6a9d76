"""The process group the torchrun scripts (tp_watch.py, sweep_ranks.py, harvest_ranks.py) start: one rank per
process."""

import os

import torch
import torch.distributed as dist


def setup() -> torch.device:
    """Start the process group: nccl + cuda:LOCAL_RANK with a GPU per process, else gloo on the CPU."""
    local_rank, world = int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
    if torch.cuda.is_available() and torch.cuda.device_count() >= world:
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl")
        return torch.device("cuda", local_rank)
    torch.set_num_threads(1)  # one core per rank
    dist.init_process_group("gloo")
    return torch.device("cpu")
