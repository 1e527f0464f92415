"""Which DP rank serves a request: the least loaded, counted in requests still in flight."""

from __future__ import annotations


class Router:
    def __init__(self, world_size: int):
        self.load = [0] * world_size            # requests in flight per rank
        self.owner: dict[str, int] = {}         # request id -> its rank

    def assign(self, request_id: str, rank: int | None = None) -> int:
        """The rank with the fewest requests in flight (the lowest rank on a tie), or `rank`."""
        if request_id in self.owner:
            raise ValueError(f"request id {request_id!r} is already running")
        if rank is None:
            rank = min(range(len(self.load)), key=lambda r: (self.load[r], r))
        self.owner[request_id] = rank
        self.load[rank] += 1
        return rank

    def release(self, request_id: str) -> int | None:
        """The request finished or was aborted: its rank has room again."""
        rank = self.owner.pop(request_id, None)
        if rank is not None:
            self.load[rank] -= 1
        return rank

    @property
    def in_flight(self) -> int:
        return len(self.owner)
