"""Engine configuration: plain dataclasses, validated once, passed explicitly everywhere."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch


def cache_root() -> Path:
    """~/.cache/dspark (under $XDG_CACHE_HOME when it is set): what dspark keeps between runs."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dspark"

DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float32": torch.float32, "fp32": torch.float32,
          "float16": torch.float16, "fp16": torch.float16}


@dataclass
class CacheConfig:
    block_size: int = 16
    # The KV cache is sized from a memory budget: explicit bytes, or a fraction of the memory
    # available when the engine starts (never more than max_num_seqs full-length requests need).
    kv_cache_bytes: int | None = None
    memory_fraction: float = 0.25

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes <= 0:
            raise ValueError(f"kv_cache_bytes must be positive, got {self.kv_cache_bytes}")
        if not 0 < self.memory_fraction <= 0.95:
            raise ValueError(f"memory_fraction must be in (0, 0.95], got {self.memory_fraction}")


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048   # per-step token budget (chunked prefill above it)

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")


@dataclass
class ParallelConfig:
    """Data parallelism: N engine replicas in one torch.distributed group, stepping in lockstep."""
    data_parallel_size: int = 1
    dp_timeout_s: float = 30.0           # a collective waiting longer stops the group, naming the rank
    dp_startup_timeout_s: float = 600.0  # loading and capturing on every rank
    dp_idle_wait_s: float = 7 * 86400.0  # ranks 1..N-1 waiting between steps for rank 0 (its
                                         # death still ends the wait at once)
    dp_host: str = "127.0.0.1"           # where rank 0 hosts the group's store
    dp_port: int = 0                     # 0: any free port

    def __post_init__(self) -> None:
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {self.data_parallel_size}")
        if not self.dp_timeout_s > 0 or not self.dp_startup_timeout_s > 0:
            raise ValueError("dp_timeout_s and dp_startup_timeout_s must be positive")


EMBEDDED = "embedded"     # the drafter shipped for the embedded target
AUTO = "auto"             # the embedded drafter for the embedded target, none for any other model
SCHEDULES = ("verify-all", "confidence")
EMBEDDED_DRAFTER_DIR = os.path.join(os.path.dirname(__file__), "assets", "smollm2-135m-instruct-dspark")


@dataclass
class SpecConfig:
    """Speculative decoding with a DSpark drafter; no drafter means plain decoding."""
    drafter: str | None = AUTO           # drafter folder (speculators or DeepSpec format), "embedded",
                                         # "auto" or None (plain decoding)
    sts: str | None = None               # STS calibration JSON for the confidence head
    spec_schedule: str = "confidence"    # verify only the drafts worth their cost, or "verify-all"
    cost_table: str | None = None        # None: measured once per setup and cached; "auto": measured
                                         # at start-up; or a `dspark profile` JSON
    min_gain: float = 0.05               # trim only for at least this predicted gain in tokens/ms
    confidence_lag: int = 2              # the budget uses confidences from this many rounds back

    def resolve_embedded(self, model: str | None) -> None:
        """"embedded" names the shipped drafter (and its calibration) of the embedded target;
        "auto" picks it when the target is the embedded one and decodes plainly otherwise."""
        if self.drafter == AUTO:
            self.drafter = EMBEDDED if model is None else None
        if self.drafter != EMBEDDED:
            return
        if model is not None:
            raise ValueError("the embedded drafter belongs to the embedded target; pass drafter=None "
                             "or a drafter trained for this model")
        if not os.path.isdir(EMBEDDED_DRAFTER_DIR):
            raise FileNotFoundError(f"the embedded drafter is missing from {EMBEDDED_DRAFTER_DIR}")
        self.drafter = EMBEDDED_DRAFTER_DIR
        sts = os.path.join(EMBEDDED_DRAFTER_DIR, "sts.json")
        if self.sts is None and os.path.isfile(sts):
            self.sts = sts

    def __post_init__(self) -> None:
        if self.drafter in (EMBEDDED, AUTO):
            self._check_schedule()
            return
        if self.drafter is not None and not os.path.exists(self.drafter):
            raise FileNotFoundError(f"drafter path {self.drafter!r} does not exist")
        if self.sts is not None and self.drafter is None:
            raise ValueError("an STS calibration file needs a drafter")
        if self.sts is not None and not os.path.exists(self.sts):
            raise FileNotFoundError(f"STS calibration file {self.sts!r} does not exist")
        self._check_schedule()

    def _check_schedule(self) -> None:
        if self.spec_schedule not in SCHEDULES:
            raise ValueError(f"spec_schedule must be one of {SCHEDULES}, got {self.spec_schedule!r}")
        if self.spec_schedule == "verify-all":
            if self.cost_table is not None:
                raise ValueError("a cost table only applies to spec_schedule='confidence'")
            return
        if self.cost_table not in (None, "auto") and not os.path.exists(self.cost_table):
            raise FileNotFoundError(f"cost table {self.cost_table!r} does not exist")
        if not self.min_gain >= 0 or self.confidence_lag < 1:
            raise ValueError(f"min_gain must be >= 0 and confidence_lag >= 1, got "
                             f"{self.min_gain} and {self.confidence_lag}")


@dataclass
class EngineConfig:
    model: str | None = None             # HF folder or GGUF file; None = the embedded default
    dtype: str = "bfloat16"
    device: str = "cpu"
    max_model_len: int | None = None     # None: the model's own limit, capped at 8192
    seed: int = 0
    num_threads: int | None = None
    graph: str = "auto"                  # auto | cuda | compile | eager: how bucketed steps run
    max_graph_tokens: int = 512          # largest bucket; larger steps (long prefills) run unpadded
    graph_fallback: bool = False         # a failed capture runs that bucket eagerly (else: error)
    generation_config: str = "auto"      # auto: the model's recommended sampling; vllm: built-ins
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    spec: SpecConfig = field(default_factory=SpecConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"unsupported dtype {self.dtype!r}; choose one of {sorted(DTYPES)}")
        if self.model is not None and not os.path.exists(self.model):
            raise FileNotFoundError(f"model path {self.model!r} does not exist")
        self.spec.resolve_embedded(self.model)
        if self.graph not in ("auto", "cuda", "compile", "eager"):
            raise ValueError(f"graph must be one of auto, cuda, compile, eager; got {self.graph!r}")
        if self.generation_config not in ("auto", "vllm"):
            raise ValueError(f"generation_config must be 'auto' or 'vllm', got {self.generation_config!r}")
        if self.max_graph_tokens < 1:
            raise ValueError(f"max_graph_tokens must be >= 1, got {self.max_graph_tokens}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]
