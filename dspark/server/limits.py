"""What one request may ask of the server, so that no client can make it slow for the others.

Each limit bounds work that is paid outside the request's own share of the engine: the request
body is read and parsed on the event loop, every stop string is scanned on every step of the
engine thread, and a batch of prompts takes that many places in the queue at once.
"""

from __future__ import annotations

from dataclasses import dataclass


class LimitExceeded(ValueError):
    """A request asks for more than a limit allows (a 400 naming `param`)."""

    def __init__(self, param: str, code: str, message: str):
        super().__init__(message)
        self.param, self.code = param, code


@dataclass(frozen=True)
class ServerLimits:
    max_request_bytes: int = 8 * 1024 * 1024     # request body; larger ones get 413
    max_prompts: int = 64                        # prompts in one /v1/completions request
    max_choices: int = 64                        # choices in one request: prompts x n
    max_stop: int = 16                           # stop strings, and stop token ids, per request
    max_stop_chars: int = 256                    # characters in one stop string
    max_pending_outputs: int = 256               # engine outputs a streaming reader may leave unread

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

    def check_stop(self, stop: list[str], stop_token_ids: list[int]) -> None:
        if len(stop) > self.max_stop:
            raise LimitExceeded("stop", "too_many_stop_strings", f"'stop' has {len(stop)} strings, "
                                f"more than this server's limit of {self.max_stop}")
        longest = max((len(s) for s in stop), default=0)
        if longest > self.max_stop_chars:
            raise LimitExceeded("stop", "stop_string_too_long", f"a stop string has {longest} "
                                f"characters, more than this server's limit of {self.max_stop_chars}")
        if len(stop_token_ids) > self.max_stop:
            raise LimitExceeded("stop_token_ids", "too_many_stop_token_ids", f"'stop_token_ids' has "
                                f"{len(stop_token_ids)} ids, more than this server's limit of {self.max_stop}")

    def check_choices(self, prompts: int, n: int) -> None:
        if prompts * n > self.max_choices:
            raise LimitExceeded("n", "too_many_choices", f"{prompts} prompt(s) x n={n} make "
                                f"{prompts * n} choices, more than this server's limit of "
                                f"{self.max_choices} per request")

    def check_prompts(self, count: int) -> None:
        if count > self.max_prompts:
            raise LimitExceeded("prompt", "too_many_prompts", f"'prompt' holds {count} prompts, more "
                                f"than this server's limit of {self.max_prompts} per request")
