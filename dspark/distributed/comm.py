"""The DP group's transport: a gloo (CPU) or NCCL-free process group plus its rendezvous store.

The group is an explicit object rather than torch.distributed's global default group, so a
process (a test, a front end) can hold one without changing what anything else computes. Every
collective carries the group's timeout: a peer that dies or stalls turns into an exception here,
never a hang. Before each collective a rank records how many it has entered in the store
(`progress`), which is how the front end names the rank that stopped (see failure.py).
"""

from __future__ import annotations

import datetime
import pickle
from dataclasses import dataclass

import torch
import torch.distributed as dist

PREFIX = "dspark/"


class CollectiveError(RuntimeError):
    """A collective failed (a peer is gone or timed out); failure.diagnose names the cause."""


def _wait(work, what: str) -> None:
    try:
        work.wait()
    except RuntimeError as exc:
        raise CollectiveError(f"collective '{what}' failed: {str(exc).splitlines()[0][:300]}") from exc


@dataclass
class GroupAddress:
    host: str
    port: int
    world_size: int


def open_store(address: GroupAddress, rank: int, timeout_s: float) -> tuple[dist.Store, int]:
    """The group's key-value store: rank 0 hosts it (port 0: any free port, returned), the others
    connect. Keys are namespaced so a torchrun agent's store can be shared."""
    store = dist.TCPStore(address.host, address.port, address.world_size, rank == 0,
                          timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)
    return dist.PrefixStore(PREFIX, store), store.port


class RankGroup:
    def __init__(self, store: dist.Store, rank: int, world_size: int, timeout_s: float):
        self.store = store
        self.rank, self.world_size = rank, world_size
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.pg = dist.ProcessGroupGloo(store, rank, world_size, self.timeout)
        self.entered = 0                          # collectives this rank has entered

    # ---- progress and errors, for the failure report -------------------------------------------
    def _enter(self, what: str) -> None:
        self.entered += 1
        self.store.set(f"progress/{self.rank}", f"{self.entered} {what}")

    def progress(self) -> dict[int, tuple[int, str]]:
        """rank -> (collectives entered, the last one's name); ranks not yet started are absent."""
        out = {}
        for r in range(self.world_size):
            key = f"progress/{r}"
            if self.store.check([key]):
                count, what = self.store.get(key).decode().split(" ", 1)
                out[r] = (int(count), what)
        return out

    def mark(self, name: str) -> None:
        self.store.set(f"{name}/{self.rank}", "1")

    def report_error(self, message: str) -> None:
        """Leave this rank's failure where rank 0 looks when a collective breaks."""
        self.store.set(f"error/{self.rank}", message[:2000])

    def errors(self) -> dict[int, str]:
        keys = [f"error/{r}" for r in range(self.world_size)]
        return {r: self.store.get(k).decode() for r, k in enumerate(keys) if self.store.check([k])}

    # ---- collectives ---------------------------------------------------------------------------
    def allgather_ints(self, values: list[int], what: str) -> list[list[int]]:
        """Every rank's row of integers, in rank order (one collective)."""
        self._enter(what)
        mine = torch.tensor(values, dtype=torch.long)
        rows = [torch.empty_like(mine) for _ in range(self.world_size)]
        _wait(self.pg.allgather([rows], [mine]), what)
        return [r.tolist() for r in rows]

    def broadcast_object(self, obj, what: str, follower_wait_s: float | None = None):
        """Rank 0's picklable object, on every rank (two collectives: size, then bytes).

        `follower_wait_s`: how long ranks 1..N-1 wait for rank 0 to start it (default: the group
        timeout). Followers idle here while rank 0 has nothing to run, which may be long; a dead
        rank 0 still breaks the wait at once (its sockets close)."""
        self._enter(what)
        payload = _to_bytes(obj) if self.rank == 0 else torch.empty(0, dtype=torch.uint8)
        size = torch.tensor([payload.numel()], dtype=torch.long)
        wait = self.timeout
        if self.rank != 0 and follower_wait_s is not None:
            wait = datetime.timedelta(seconds=follower_wait_s)
        _wait(self.pg.broadcast(size, 0, wait), what)
        if self.rank != 0:
            payload = torch.empty(int(size), dtype=torch.uint8)
        if int(size):
            _wait(self.pg.broadcast(payload, 0), what)
        return obj if self.rank == 0 else _from_bytes(payload)

    def gather_objects(self, obj, what: str) -> list | None:
        """Every rank's object on rank 0, in rank order (None elsewhere)."""
        payload = _to_bytes(obj)
        sizes = self.allgather_ints([payload.numel()], what)
        longest = max(s[0] for s in sizes)
        padded = torch.zeros(longest, dtype=torch.uint8)
        padded[:payload.numel()] = payload
        opts = dist.GatherOptions()
        opts.rootRank = 0
        opts.timeout = self.timeout
        out = [[torch.empty(longest, dtype=torch.uint8) for _ in range(self.world_size)]] if self.rank == 0 else []
        _wait(self.pg.gather(out, [padded], opts), what)
        if self.rank != 0:
            return None
        return [_from_bytes(t[:s[0]]) for t, s in zip(out[0], sizes)]


def _to_bytes(obj) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)


def _from_bytes(t: torch.Tensor):
    return pickle.loads(t.numpy().tobytes())
