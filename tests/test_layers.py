"""Imports go down the layers, never up: a lower layer stays usable and testable without the ones above.

Every module under dspark/ is parsed (not imported) and every import statement is checked:
module level, inside functions and under TYPE_CHECKING, `import x` and `from x import y`,
absolute or relative. A module may import its own layer or a lower one.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "dspark"

# Top to bottom. Each entry: a module or package (matched by longest dotted prefix) and why it
# sits there. A new top-level module fails the test until it is placed here.
LAYERS: list[tuple[str, dict[str, str]]] = [
    ("tools", {
        "dspark.cli": "the command line; wraps everything below",
        "dspark.bench": "benchmark harnesses; drive the offline API, the server and the planner",
        "dspark.train": "drafter training; builds data with the offline API, nothing imports it",
        "dspark.calibrate": "`dspark calibrate`: runs the offline API to fit STS",
    }),
    ("server", {
        "dspark.server": "the OpenAI HTTP API over one engine or a data-parallel group",
    }),
    ("api", {
        "dspark": "the package root re-exports LLM and the request types",
        "dspark.llm": "offline API: builds the config, then one Engine or a data-parallel group",
    }),
    ("distributed", {
        "dspark.distributed": "data parallelism: each rank drives an Engine in lockstep",
    }),
    ("engine", {
        "dspark.engine": "request lifetime on the host: sequences, blocks, scheduler, commit",
    }),
    ("worker", {
        "dspark.worker": "a step's device work: inputs, KV cache, penalties, log-probs, acceptance",
    }),
    ("runner", {
        "dspark.runner": "how a step's forwards run (graphs, compile, fused CPU layers), chosen once",
    }),
    ("spec", {
        "dspark.spec": "the DSpark algorithm and the sampler that draft, verify and plain rows share",
    }),
    ("models", {
        "dspark.models": "target, drafter and their loaders",
        "dspark.tokenizer": "reads its vocabulary from GGUF metadata through models/gguf.py",
        "dspark.generation_config": "a model's recommended sampling, read from its files",
    }),
    ("layers", {
        "dspark.models.layers": "attention, linear, norm, rotary; they call the kernels where they run",
    }),
    ("kernels", {
        "dspark.kernels": "the C++ CPU kernels: build, load, limits, fake implementations; no model code",
    }),
    ("shared", {
        "dspark.config": "validated config dataclasses and the cache directory; imports nothing of dspark",
        "dspark.config_flags": "command-line flags generated from the config fields",
        "dspark.sampling_params": "per-request sampling parameters",
        "dspark.outputs": "what a request returns",
        "dspark.host_copy": "host tensors to the device without a wait, results back with one",
    }),
]

RANK = {name: i for i, (_, members) in enumerate(LAYERS) for name in members}
LAYER_NAME = {name: layer for layer, members in LAYERS for name in members}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def owner(module: str) -> str | None:
    """The LAYERS entry a dotted module belongs to: its longest listed prefix."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        prefix = ".".join(parts[:n])
        if prefix in RANK:
            return prefix
    return None


def is_module(name: str) -> bool:
    rel = Path(*name.split(".")[1:])
    return (PACKAGE / rel).with_suffix(".py").is_file() or (PACKAGE / rel / "__init__.py").is_file()


def imported(path: Path, tree: ast.Module) -> list[tuple[int, str]]:
    """(line, dotted module) for every dspark module the file imports."""
    here = module_name(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:           # `from pkg import submodule` imports the submodule
                sub = f"{source}.{alias.name}"
                found.append((node.lineno, sub if is_module(sub) else source))
    return sorted({(line, name) for line, name in found if name == "dspark" or name.startswith("dspark.")})


def sources() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_every_module_has_a_layer():
    unplaced = [str(p.relative_to(PACKAGE.parent)) for p in sources() if owner(module_name(p)) is None]
    assert not unplaced, "modules missing from LAYERS in tests/test_layers.py:\n" + "\n".join(unplaced)


def test_every_listed_name_exists():
    missing = [name for name in RANK if not is_module(name)]
    assert not missing, f"LAYERS lists modules that do not exist: {missing}"


def test_imports_go_down():
    violations = []
    for path in sources():
        here = owner(module_name(path))
        if here is None:
            continue
        for line, target in imported(path, ast.parse(path.read_text(), str(path))):
            there = owner(target)
            if there is None:
                violations.append(f"{path.relative_to(PACKAGE.parent)}:{line}: imports {target}, "
                                  "which is in no layer")
            elif RANK[there] < RANK[here]:
                violations.append(f"{path.relative_to(PACKAGE.parent)}:{line}: "
                                  f"{LAYER_NAME[here]} imports {target} ({LAYER_NAME[there]}, above it)")
    order = " -> ".join(layer for layer, _ in LAYERS)
    assert not violations, f"imports must go down ({order}):\n" + "\n".join(violations)
