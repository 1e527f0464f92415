"""The engine flags come from the config dataclasses: one flag per field, the field's default,
its help, and the parsed flags back as the same EngineConfig, in every command that takes them."""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys

import pytest

from dspark.cli import build_parser, main
from dspark.config import EngineConfig
from dspark.config_flags import add_engine_flags, engine_argv, engine_config_from_args, engine_flags

# Commands that start an engine, with the flags each needs besides the engine's.
ENGINE_COMMANDS = {"generate": [], "chat": [], "demo": [], "serve": [], "bench": [],
                   "calibrate": ["--out", "x.json"], "profile": ["--out", "x.json"],
                   "prune-vocab": ["--out", "x"]}
# Fields a command sets otherwise than EngineConfig() does on purpose: none today.
COMMAND_SPECIFIC: dict[str, set[str]] = {command: set() for command in ENGINE_COMMANDS}


def config_fields() -> dict[str, tuple[str | None, dataclasses.Field]]:
    """field name -> (section, field) for every leaf of EngineConfig, walked here independently."""
    leaves = {}
    for f in dataclasses.fields(EngineConfig):
        factory = f.default_factory
        if dataclasses.is_dataclass(factory):
            leaves.update({g.name: (f.name, g) for g in dataclasses.fields(factory)})
        else:
            leaves[f.name] = (None, f)
    return leaves


def config_value(config: EngineConfig, name: str) -> object:
    section, _ = config_fields()[name]
    return getattr(config if section is None else getattr(config, section), name)


def engine_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    return parser


def test_every_field_has_a_flag_with_its_default_and_help():
    flags = {flag.field.name: flag for flag in engine_flags()}
    assert set(flags) == set(config_fields())
    parser = engine_parser()
    parsed = vars(parser.parse_args([]))
    shown = " ".join(parser.format_help().split())
    for name, (section, f) in config_fields().items():
        flag = flags[name]
        assert flag.section == section
        assert parsed[flag.dest] == f.default, f"--{name}: flag default drifted from the field's"
        help_text = " ".join(f.metadata.get("help", "").split())
        assert help_text, f"the field {name} has no help text"
        assert f"{flag.name} " in shown and help_text[:30] in shown


@pytest.mark.parametrize("command", sorted(ENGINE_COMMANDS))
def test_no_flags_give_the_default_config(command):
    args = build_parser().parse_args([command, *ENGINE_COMMANDS[command]])
    got, want = engine_config_from_args(args), EngineConfig()
    skip = COMMAND_SPECIFIC[command]
    for name in config_fields():
        if name not in skip:
            assert config_value(got, name) == config_value(want, name), name


def non_default_argv(tmp_path) -> dict[str, list[str]]:
    """One non-default value for every field, as the command line spells it."""
    model, drafter = tmp_path / "model", tmp_path / "drafter"
    model.mkdir(), drafter.mkdir()
    (tmp_path / "sts.json").write_text("{}")
    (tmp_path / "costs.json").write_text("{}")
    return {"model": ["--model", str(model)], "dtype": ["--dtype", "float32"],
            "device": ["--device", "cuda:1"], "max_model_len": ["--max-model-len", "256"],
            "num_threads": ["--threads", "3"], "graph": ["--graph", "eager"],
            "max_graph_tokens": ["--max-graph-tokens", "64"], "graph_fallback": ["--graph-fallback"],
            "generation_config": ["--generation-config", "vllm"], "block_size": ["--block-size", "8"],
            "kv_cache_bytes": ["--kv-cache-bytes", "4096"], "memory_fraction": ["--memory-fraction", "0.5"],
            "max_num_seqs": ["--max-num-seqs", "5"],
            "max_num_batched_tokens": ["--max-num-batched-tokens", "99"],
            "drafter": ["--drafter", str(drafter)], "sts": ["--sts", str(tmp_path / "sts.json")],
            "spec_schedule": ["--spec-schedule", "confidence"],
            "cost_table": ["--cost-table", str(tmp_path / "costs.json")], "min_gain": ["--min-gain", "0.2"],
            "confidence_lag": ["--confidence-lag", "1"], "max_kept_plans": ["--max-kept-plans", "0"], "data_parallel_size": ["--dp", "2"],
            "dp_timeout_s": ["--dp-timeout", "7.5"], "dp_startup_timeout_s": ["--dp-startup-timeout", "60"],
            "dp_idle_wait_s": ["--dp-idle-wait", "9"], "dp_host": ["--dp-host", "10.0.0.2"],
            "dp_port": ["--dp-port", "29500"]}


def expected(name: str, argv: list[str]) -> object:
    flag = next(flag for flag in engine_flags() if flag.field.name == name)
    return True if flag.kind is bool else flag.kind(argv[-1])


def test_every_flag_reaches_the_config(tmp_path):
    argv = non_default_argv(tmp_path)
    assert set(argv) == set(config_fields()), "give every field a non-default value here"
    config = engine_config_from_args(engine_parser().parse_args(sum(argv.values(), [])))
    for name, words in argv.items():
        if name != "spec_schedule":                 # its default; verify-all takes no cost table
            assert expected(name, words) != config_value(EngineConfig(), name), name
        assert config_value(config, name) == expected(name, words), name
    verify_all = engine_parser().parse_args(["--spec-schedule", "verify-all"])
    assert engine_config_from_args(verify_all).spec.spec_schedule == "verify-all"


def test_no_drafter_wins_over_a_drafter(tmp_path):
    parser = engine_parser()
    assert engine_config_from_args(parser.parse_args(["--no-drafter"])).spec.drafter is None
    args = parser.parse_args(["--drafter", str(tmp_path), "--no-drafter"])
    assert engine_config_from_args(args).spec.drafter is None and args.no_drafter


def test_engine_argv_gives_another_process_the_same_config(tmp_path):
    parser = engine_parser()
    for words in (sum(non_default_argv(tmp_path).values(), []), [], ["--no-drafter", "--threads", "1"]):
        args = parser.parse_args(words)
        argv = engine_argv(args)
        assert engine_config_from_args(parser.parse_args(argv)) == engine_config_from_args(args), words
        assert len(argv) <= len(words), "only the fields that differ from their defaults"


def engine_help(command: str, capsys) -> str:
    """The engine sections of `dspark COMMAND --help`."""
    with pytest.raises(SystemExit):
        main([command, "--help"])
    sections = capsys.readouterr().out.split("\n\n")
    return "\n\n".join(s.strip() for s in sections if s.startswith("engine"))


def test_serve_generate_and_bench_show_the_same_engine_flags(capsys):
    shown = {command: engine_help(command, capsys) for command in ("serve", "generate", "bench")}
    assert shown["serve"] == shown["generate"] == shown["bench"]
    for flag in engine_flags():
        assert f"  {flag.name} " in shown["serve"] or f"  {flag.name}\n" in shown["serve"], flag.name


def test_the_parser_imports_no_server_dependency():
    code = ("import sys; from dspark.cli import build_parser; build_parser(); "
            "print(sorted(m for m in ('fastapi', 'uvicorn', 'pydantic') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
