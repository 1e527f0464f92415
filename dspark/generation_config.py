"""The model's recommended sampling: generation_config.json, or GGUF `general.sampling.*` metadata.

Model authors ship the temperature / top_p / top_k their model was tuned for.  vLLM's default
`--generation-config auto` makes those the defaults of every request field the client leaves
unset, so the same model samples the same way behind either server; `vllm` ignores them.  An
explicit request value always wins.  Offline, `SamplingParams()` keeps its own defaults and
`LLM.get_default_sampling_params()` returns the model's, as in vLLM.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

from dspark.sampling_params import ParamError, SamplingParams


FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
# transformers' GenerationConfig defaults: vLLM applies only the values that differ from them
# (its `to_diff_dict`), so a file restating one of these leaves the engine's own default.
HF_DEFAULTS: dict[str, Any] = {"temperature": 1.0, "top_k": 50, "top_p": 1.0, "min_p": None,
                               "repetition_penalty": 1.0}
GGUF_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
             "general.sampling.top_k": "top_k", "general.sampling.min_p": "min_p",
             "general.sampling.penalty_repeat": "repetition_penalty"}
MODES = ("auto", "vllm")

Defaults = dict[str, float | int]


def sampling_defaults(model: str | None, mode: str = "auto") -> Defaults:
    """The defaults unset request fields take: the model's under `auto`, none under `vllm`.
    A value the engine cannot use is an error naming the file, raised at start-up."""
    if mode not in MODES:
        raise ValueError(f"generation_config must be one of {', '.join(MODES)}; got {mode!r}")
    if mode == "vllm":
        return {}
    path = model if model is not None else _embedded_model()
    raw = read_gguf_sampling(path) if os.path.isfile(path) else read_folder_sampling(path)
    return _usable(raw, path)


def default_sampling_params(model: str | None, mode: str = "auto", **overrides: Any) -> SamplingParams:
    """SamplingParams with the model's defaults (and `overrides` on top)."""
    return SamplingParams(**{**sampling_defaults(model, mode), **overrides})


def describe(defaults: Defaults, mode: str) -> str:
    """One line for the start-up log: which sampling defaults unset request fields get."""
    builtin = SamplingParams()
    base = ", ".join(f"{name}={getattr(builtin, name)}" for name in FIELDS if name not in defaults)
    if not defaults:
        why = "--generation-config vllm" if mode == "vllm" else "the model recommends none"
        return f"sampling defaults: built-in ({base}; {why})"
    model = ", ".join(f"{name}={value}" for name, value in defaults.items())
    rest = f"; built-in {base}" if base else ""
    return (f"sampling defaults: the model's {model}{rest} "
            "(--generation-config vllm to use the built-in defaults)")


def read_folder_sampling(path: str) -> dict[str, Any]:
    """The sampling fields of `generation_config.json` that differ from transformers' defaults."""
    file = os.path.join(path, "generation_config.json")
    if not os.path.isfile(file):
        return {}
    try:
        with open(file) as f:
            config = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{file} is not valid JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise ValueError(f"{file} must hold a JSON object")
    return {name: config[name] for name in FIELDS
            if config.get(name) is not None and config[name] != HF_DEFAULTS[name]}


def read_gguf_sampling(path: str) -> dict[str, Any]:
    """The `general.sampling.*` values a GGUF file carries (llama.cpp writes them only when the
    model's author set them)."""
    from dspark.models.gguf import open_reader
    fields = open_reader(path).fields
    return {name: fields[key].contents() for key, name in GGUF_KEYS.items() if key in fields}


def _usable(raw: dict[str, Any], source: str) -> Defaults:
    picked: Defaults = {}
    for name, value in raw.items():
        picked[name] = _number(name, value, source)
    try:
        SamplingParams(**picked)
    except ParamError as exc:
        raise ValueError(f"the recommended sampling of {source} is unusable: {exc}") from exc
    return picked


def _number(name: str, value: Any, source: str) -> float | int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise ValueError(f"the recommended sampling of {source} has a non-numeric {name}: {value!r}")
    if name == "top_k":
        if value != int(value):
            raise ValueError(f"the recommended sampling of {source} has a fractional top_k: {value}")
        return int(value)
    return float(value)


def _embedded_model() -> str:
    from dspark.config import default_model_path       # config imports torch
    return default_model_path()
