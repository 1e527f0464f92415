"""Per-request sampling parameters, validated at construction so bad input fails before queueing.

Every value must also be representable where the engine puts it (a seed in a generator, top_k in
an int64 tensor): a value that passes here can never fail a step shared with other requests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

INT64_MIN, INT64_MAX = -(2 ** 63), 2 ** 63 - 1
# Below this a temperature is greedy (as in vLLM): dividing fp32 logits by it would overflow.
GREEDY_TEMPERATURE = 1e-5
# The most top log-probabilities a request may ask for per token (OpenAI's and vLLM's bound).
MAX_LOGPROBS = 20
MAX_PENALTY = 2.0       # presence and frequency penalties lie in [-2, 2] (OpenAI's range)
MAX_LOGIT_BIAS = 100.0  # a logit bias lies in [-100, 100] (OpenAI's range)
MAX_N = 16384           # completions per prompt (vLLM's default VLLM_MAX_N_SEQUENCES)


class ParamError(ValueError):
    """A sampling parameter is out of range; `param` names it (the server's 400 carries it)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    """How one request samples. `n` > 1 asks for n completions of the prompt (parallel sampling,
    engine/parallel_sampling.py): the prompt is prefilled once and its blocks shared. The seed
    rule is vLLM's (vllm/v1/engine/parallel_sampling.py, ParentRequest): completion i samples as
    a request with `seed + i` would (`seed` None: each unseeded), so `n=4, seed=s` gives exactly
    the four requests seeded s, s+1, s+2, s+3. As in vLLM, greedy sampling takes n = 1 only (n
    greedy completions would be n copies of one)."""
    temperature: float = 1.0          # 0 (below GREEDY_TEMPERATURE) means greedy
    top_k: int = 0                    # 0 or -1 disables
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None          # top log-probs per generated token (0: the chosen one's only)
    prompt_logprobs: int | None = None   # top log-probs per prompt token (the first has none)
    repetition_penalty: float = 1.0      # > 0; tokens of prompt and output: logit > 0 divided, < 0 multiplied
    presence_penalty: float = 0.0        # [-2, 2], subtracted once from every token the output holds
    frequency_penalty: float = 0.0       # [-2, 2], subtracted once per occurrence in the output
    logit_bias: dict[int, float] = field(default_factory=dict)   # token id -> bias in [-100, 100]
    min_tokens: int = 0                  # EOS and stop_token_ids are banned until this many exist
    include_stop_str_in_output: bool = False   # keep the stop string that ended the text
    n: int = 1                           # completions of the prompt (completion i: seed + i)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if _is_int(self.top_k) and self.top_k == -1:
            self.top_k = 0
        _check("temperature", _is_number(self.temperature) and 0 <= self.temperature < math.inf,
               f"temperature must be a finite number >= 0, got {self.temperature!r}")
        _check("top_p", _is_number(self.top_p) and 0 < self.top_p <= 1,
               f"top_p must be in (0, 1], got {self.top_p!r}")
        _check("top_k", _is_int(self.top_k) and 0 <= self.top_k <= INT64_MAX,
               f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        _check("min_p", _is_number(self.min_p) and 0 <= self.min_p <= 1,
               f"min_p must be in [0, 1], got {self.min_p!r}")
        _check("max_tokens", _is_int(self.max_tokens) and self.max_tokens >= 1,
               f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        _check("seed", self.seed is None or (_is_int(self.seed) and INT64_MIN <= self.seed <= INT64_MAX),
               f"seed must be an integer in [-2**63, 2**63 - 1], got {self.seed!r}")
        self._check_n()
        _check("stop", all(isinstance(s, str) and s for s in self.stop),
               "stop strings must be non-empty strings")
        _check("stop_token_ids", all(_is_int(t) and 0 <= t <= INT64_MAX for t in self.stop_token_ids),
               "stop_token_ids must be non-negative integers")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(name, value is None or (_is_int(value) and 0 <= value <= MAX_LOGPROBS),
                   f"{name} must be null or an integer in [0, {MAX_LOGPROBS}], got {value!r}")
        self._check_penalties()

    def _check_n(self) -> None:
        """n completions: vLLM's bound and its refusal of greedy n > 1; completion i's seed
        (seed + i) must stay a valid seed."""
        _check("n", _is_int(self.n) and 1 <= self.n <= MAX_N,
               f"n must be an integer in [1, {MAX_N}], got {self.n!r}")
        _check("n", self.n == 1 or not self.greedy,
               f"n must be 1 when using greedy sampling (temperature 0), got {self.n}")
        _check("seed", self.seed is None or self.seed + self.n - 1 <= INT64_MAX,
               f"seed + n - 1 (the last completion's seed) must be at most 2**63 - 1, got seed={self.seed}")

    def _check_penalties(self) -> None:
        """The logits adjustments (worker/penalties.py); a token id's upper bound is the
        vocabulary, checked by `check_vocab` once the engine knows it."""
        _check("logit_bias", self.logit_bias is None or isinstance(self.logit_bias, dict),
               f"logit_bias must be a mapping of token ids to biases, got {type(self.logit_bias).__name__}")
        self.logit_bias = dict(self.logit_bias or {})
        _check("repetition_penalty", _is_number(self.repetition_penalty)
               and 0 < self.repetition_penalty < math.inf,
               f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(name, _is_number(value) and -MAX_PENALTY <= value <= MAX_PENALTY,
                   f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value!r}")
        for token, bias in self.logit_bias.items():
            _check("logit_bias", _is_int(token) and 0 <= token <= INT64_MAX,
                   f"logit_bias keys must be non-negative token ids, got {token!r}")
            _check("logit_bias", _is_number(bias) and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS,
                   f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                   f"got {bias!r} for token {token}")
        _check("min_tokens", _is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
               f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        _check("include_stop_str_in_output", isinstance(self.include_stop_str_in_output, bool),
               f"include_stop_str_in_output must be a bool, got {self.include_stop_str_in_output!r}")

    def check_vocab(self, vocab_size: int) -> None:
        """The bounds only the model knows: top_k, and a bias on a token the model does not have
        (an error naming logit_bias, not ignored)."""
        _check("top_k", self.top_k <= vocab_size,
               f"top_k must be at most the vocabulary size ({vocab_size}), got {self.top_k}")
        outside = sorted(t for t in self.logit_bias if t >= vocab_size)
        if outside:
            raise ParamError("logit_bias", f"logit_bias token ids must be in [0, {vocab_size}), "
                             f"got {outside[0]}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def adjusts_logits(self) -> bool:
        """Whether a penalty, a bias or min_tokens changes the logits this request samples from
        (only then does the worker build its token counts)."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0 or bool(self.logit_bias) or self.min_tokens > 0)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)


def _check(param: str, ok: bool, message: str) -> None:
    if not ok:
        raise ParamError(param, message)
