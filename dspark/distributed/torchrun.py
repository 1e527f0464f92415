"""The same entry point under torchrun: each process torchrun starts is one DP rank.

torchrun (or any launcher with its environment contract: RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT) starts `dspark serve` once per rank, across machines if asked; rank 0 serves HTTP
and leads the group, the others follow it. Without that environment the group is spawned here.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch.distributed as dist

from dspark.config import EngineConfig
from dspark.distributed.comm import PREFIX


@dataclass
class TorchrunRank:
    config: EngineConfig
    rank: int
    store: dist.Store

    def start(self):
        """Rank 0: lead the group (returns its DPEngine)."""
        from dspark.distributed.group import lead_group
        return lead_group(self.config, self.store, {})

    def serve_forever(self) -> int:
        """Ranks 1..N-1: follow rank 0 until it stops the group (exits the process on failure)."""
        from dspark.distributed.group import follow_group
        follow_group(self.config, self.store, self.rank)
        return 0


def torchrun_rank(config: EngineConfig) -> TorchrunRank | None:
    """This process's rank when a launcher started it as one (None: not launched that way)."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    world = int(os.environ["WORLD_SIZE"])
    asked = config.parallel.data_parallel_size
    if asked not in (1, world):
        raise ValueError(f"--dp {asked} disagrees with the launcher's WORLD_SIZE={world}")
    config = dataclasses.replace(config, parallel=dataclasses.replace(config.parallel,
                                                                      data_parallel_size=world))
    from dspark.distributed.group import rank_device, split_threads
    config = split_threads(config, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    config = rank_device(config, int(os.environ.get("LOCAL_RANK", "0")))
    store, rank, _ = next(dist.rendezvous("env://", timeout=_timedelta(config)))
    return TorchrunRank(config, rank, dist.PrefixStore(PREFIX, store))


def _timedelta(config: EngineConfig):
    import datetime
    return datetime.timedelta(seconds=config.parallel.dp_startup_timeout_s)
