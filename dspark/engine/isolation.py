"""One request's fault fails that request alone: a failed step's requests run again one at a
time, and the one that fails alone is failed. Why a rerun is exact, and why a fault no request
reproduces alone is not retried twice: docs/serving.md, "One request's fault fails that request
alone"."""

from __future__ import annotations

import logging
from collections import deque

from dspark.engine.sequence import Sequence, SequenceStatus

logger = logging.getLogger(__name__)


class FailureIsolation:
    def __init__(self):
        self.suspects: deque[str] = deque()      # request ids still to be run alone
        self.culprit_found = False               # the current isolation failed a request alone
        self.unexplained = False                 # the last isolation found no culprit

    def begin(self, request_ids: list[str], error: BaseException) -> bool:
        """After a failed step of several requests: isolate them (True), or fail them all
        (False) when there is one request, or the previous isolation explained nothing."""
        if len(request_ids) <= 1 or self.unexplained:
            self.unexplained = False
            return False
        logger.warning("a step of %d requests failed (%s: %s); running them one at a time to find "
                       "the one that fails", len(request_ids), type(error).__name__, error)
        self.suspects.extend(request_ids)
        self.culprit_found = False
        return True

    def next_suspect(self, requests: dict[str, Sequence]) -> Sequence | None:
        """The next suspect still running (finished or aborted ones are skipped)."""
        while self.suspects:
            seq = requests.get(self.suspects[0])
            if seq is not None and seq.status == SequenceStatus.RUNNING:
                return seq
            self.suspects.popleft()
        return None

    def done_with(self, seq: Sequence, failed: bool) -> None:
        if self.suspects and self.suspects[0] == seq.request_id:
            self.suspects.popleft()
        self.culprit_found |= failed
        if not self.suspects:
            self.unexplained = not self.culprit_found
            if self.unexplained:
                logger.warning("no request failed alone: the next failed step fails all its requests")

    def step_succeeded(self) -> None:
        self.unexplained = False
