"""The offline API: `LLM(model).generate(prompts, params)`."""

from __future__ import annotations

from dataclasses import fields
from typing import Sequence as Seq

from tqdm import tqdm

from dspark.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig, SpecConfig
from dspark.engine.engine import Engine
from dspark.engine.parallel_sampling import request_ids
from dspark.outputs import RequestOutput, merge_outputs
from dspark.sampling_params import SamplingParams


class LLM:
    """Completes raw prompts (no chat template); one RequestOutput per prompt, in order (with
    `SamplingParams.n > 1` its `outputs` holds the n completions; text and token_ids are the first's).

    With no model, the embedded SmolLM2-135M-Instruct is served with its shipped DSpark drafter
    and calibration; `drafter=None` decodes plainly, a folder names another drafter.
    """

    def __init__(self, model: str | None = None, dtype: str = "bfloat16", drafter: str | None = "auto",
                 **kwargs):
        self._start(build_config(model=model, dtype=dtype, drafter=drafter, **kwargs))

    @classmethod
    def from_config(cls, config: EngineConfig) -> "LLM":
        llm = cls.__new__(cls)
        llm._start(config)
        return llm

    def _start(self, config: EngineConfig) -> None:
        """One engine, or with data_parallel_size > 1 a group whose rank 0 runs here."""
        if config.parallel.data_parallel_size > 1:
            from dspark.distributed.group import start_group
            self.engine = start_group(config)
        else:
            self.engine = Engine(config)
        self.tokenizer = self.engine.tokenizer

    def close(self) -> None:
        """Stop a data-parallel group's ranks (nothing to do for one engine)."""
        self.engine.close()

    def get_default_sampling_params(self) -> SamplingParams:
        """The model's recommended sampling (generation_config.json or GGUF metadata), as the
        server applies it to unset request fields; `SamplingParams()` stays the neutral default.
        With generation_config="vllm", the built-in defaults."""
        from dspark.generation_config import default_sampling_params
        config = self.engine.config
        return default_sampling_params(config.model, config.generation_config)

    def generate(self, prompts: str | list[int] | Seq[str] | Seq[list[int]],
                 params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params or SamplingParams()
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(plist)} sampling params")
        ids: list[str] = []
        try:
            ids.extend(self.engine.add_request(p, sp) for p, sp in zip(prompts, plist))
            done = self._run(sum(sp.n for sp in plist), use_tqdm)
        except BaseException:         # a bad prompt, a refused step, Ctrl-C: leave nothing queued
            for i in ids:
                self.engine.abort(i)
            raise
        children = [request_ids(i, sp.n) for i, sp in zip(ids, plist)]      # n > 1: one per completion
        return [done[i] if sp.n == 1 else merge_outputs(i, [done[c] for c in cs])
                for i, sp, cs in zip(ids, plist, children)]

    def _run(self, completions: int, use_tqdm: bool) -> dict[str, RequestOutput]:
        """Step until the engine is idle -> the finished outputs by request id."""
        done: dict[str, RequestOutput] = {}
        with tqdm(total=completions, desc="generate", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished:
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        bar.update(1)
        return done

    def chat(self, messages: list[dict], params: SamplingParams | None = None) -> RequestOutput:
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer, so no chat template")
        prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        return self.generate([ids], params)[0]


def build_config(**kwargs) -> EngineConfig:
    """Route flat keyword arguments to the engine, cache and scheduler sections."""
    sections = {"cache": CacheConfig, "scheduler": SchedulerConfig, "spec": SpecConfig,
                "parallel": ParallelConfig}
    picked: dict[str, dict] = {name: {} for name in sections}
    top = {}
    for key, value in kwargs.items():
        owner = next((n for n, cls in sections.items() if key in {f.name for f in fields(cls)}), None)
        if owner is not None:
            picked[owner][key] = value
        elif key in {f.name for f in fields(EngineConfig)}:
            top[key] = value
        else:
            raise TypeError(f"unknown engine argument {key!r}")
    return EngineConfig(**top, **{n: cls(**picked[n]) for n, cls in sections.items()})
