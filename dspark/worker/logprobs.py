"""Log-probabilities of committed and prompt tokens, computed on the device for the requests
that ask: the target's raw ones, read at the row that committed each token, so they do not
depend on speculation (docs/serving.md, "Log-probabilities"). Each wanted row becomes [token,
its log-prob, top-k log-probs, top-k ids] and travels with the step's other results to the host.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dspark.host_copy import device_tensor
from dspark.outputs import TokenLogprobs
from dspark.worker.inputs import RequestChunk


@dataclass
class PromptLogprobRows:
    """The prompt positions of one chunk whose log-probs this step returns; positions already
    returned (before a preemption) are not asked again."""
    chunk: int                     # the chunk's index in the step
    rows: range                    # offsets in the chunk (its `prompt_rows`)
    next_tokens: list[int]         # per row: the prompt token that row predicts
    top: int                       # top log-probs wanted per row


def prompt_logprob_rows(chunk: int, prompt: list[int], known: list | None, start: int,
                        num_tokens: int, top: int | None) -> PromptLogprobRows | None:
    """The rows of a chunk over positions [start, start + num_tokens) that give prompt log-probs
    not yet `known` (the request's entries so far, the first token's None included; None when it
    asks for none): the row at position p predicts prompt token p + 1."""
    if known is None or top is None:
        return None
    first = max(start, len(known) - 1)
    last = min(start + num_tokens, len(prompt) - 1)
    if first >= last:
        return None
    return PromptLogprobRows(chunk, range(first - start, last - start), prompt[first + 1:last + 1], top)


def split_logits(logits: torch.Tensor, chunks: list[RequestChunk]
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[N, V] logits laid out per chunk as [prompt rows, sampled rows] -> (sampled rows [S, V],
    prompt rows [P, V] or None). Without prompt rows the logits pass through untouched."""
    if not any(c.prompt_rows for c in chunks):
        return logits, None
    sampled, prompt, row = [], [], 0
    for c in chunks:
        prompt += range(row, row + len(c.prompt_rows))
        row += len(c.prompt_rows)
        sampled += range(row, row + c.num_logits)
        row += c.num_logits
    index = lambda rows: device_tensor(rows, torch.long, logits.device)  # noqa: E731
    return logits.index_select(0, index(sampled)), logits.index_select(0, index(prompt))


def row_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> torch.Tensor:
    """logits [N, V], tokens [N] -> [N, 2 + 2k]: token, its log-prob, the top-k log-probs and
    their ids (ids as floats: exact below 2**24, far above any vocabulary)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)                      # [N, V]
    chosen = logprobs.gather(1, tokens[:, None].long())                      # [N, 1]
    values, ids = logprobs.topk(k, dim=-1)                                   # [N, k]
    return torch.cat([tokens[:, None].float(), chosen, values, ids.float()], dim=1)


@dataclass
class _Group:
    prompt: bool                   # prompt rows (else committed-token rows)
    owner: int                     # sampling chunk index (committed) or chunk index (prompt)
    rows: int
    top: int                       # wanted per row
    k: int                         # computed per row (the group's widest wish, at most V)


@dataclass
class LogprobCollector:
    """The step's log-prob rows on the device and, on the host, whose rows they are."""
    parts: list[torch.Tensor] = field(default_factory=list)     # each [n, 2 + 2k]
    groups: list[_Group] = field(default_factory=list)

    def add(self, logits: torch.Tensor, tokens: torch.Tensor, owners: list[int], tops: list[int],
            prompt: bool = False) -> None:
        """logits [N, V] and tokens [N] of several owners' rows, N split evenly between them
        (committed rows) or as each owner's row count (`prompt`, one owner per call)."""
        k = min(max(tops), logits.shape[-1])
        self.parts.append(row_logprobs(logits, tokens, k))
        rows = logits.shape[0] // len(owners)
        self.groups += [_Group(prompt, owner, rows, min(top, k), k) for owner, top in zip(owners, tops)]

    def add_prompt(self, logits: torch.Tensor, wanted: list[PromptLogprobRows]) -> None:
        """Prompt rows [P, V], in chunk order, of the chunks in `wanted`."""
        row = 0
        for w in wanted:
            n = len(w.next_tokens)
            tokens = device_tensor(w.next_tokens, torch.long, logits.device)
            self.add(logits[row:row + n], tokens, [w.chunk], [w.top], prompt=True)
            row += n

    def unpack(self, parts: list[list[list[float]]]) -> tuple[dict[int, list[TokenLogprobs]],
                                                              dict[int, list[TokenLogprobs]]]:
        """The host copies of the parts -> (per sampling request: its rows' entries, per chunk:
        its prompt rows' entries)."""
        rows = [row for part in parts for row in part]
        committed: dict[int, list[TokenLogprobs]] = {}
        prompt: dict[int, list[TokenLogprobs]] = {}
        pos = 0
        for g in self.groups:
            entries = [_entry(row, g.k, g.top) for row in rows[pos:pos + g.rows]]
            (prompt if g.prompt else committed)[g.owner] = entries
            pos += g.rows
        return committed, prompt


def _entry(row: list[float], k: int, top: int) -> TokenLogprobs:
    """[token, log-prob, top-k values, top-k ids] -> {token: log-prob, then the top ones}."""
    entry = {int(row[0]): row[1]}
    for value, token in zip(row[2:2 + top], row[2 + k:2 + k + top]):
        entry.setdefault(int(token), value)
    return entry
