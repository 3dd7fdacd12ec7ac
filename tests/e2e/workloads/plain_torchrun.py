"""Training code written for torchrun, with no Castor in it: it reads the torchrun environment, joins a
gloo process group, all-reduces its rank and writes what it saw."""

import json
import os
import sys

import torch
import torch.distributed as dist

dist.init_process_group("gloo")  # MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE from the environment
total = torch.tensor([float(dist.get_rank())])
dist.all_reduce(total)
seen = {
    key: os.environ[key] for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK")
}
with open(os.path.join(sys.argv[1], f"rank-{dist.get_rank()}.json"), "w") as out:
    json.dump({"env": seen, "sum_of_ranks": total.item()}, out)
dist.destroy_process_group()
