"""The import graph of the pdserve modules, read from the source with ast: no cycles, the kernels,
the engine and kvtransfer import nothing above them, and no other part of the product imports the
engine's internal modules.

For cycles an import counts when it runs with its module: at the top level, under ``if
TYPE_CHECKING`` or ``try``, in a class body; an import inside a function runs only when the
function does. For the boundaries between the parts every import counts, a function's too.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGE = "pdserve"
FOLDERS = ("bench", "cluster", "decode_worker", "engine", "kernels", "kvtransfer", "prefill_worker", "router")
# What the engine offers the rest of the product; its other modules are its own business.
ENGINE_API = {
    "config",  # EngineConfig, ModelConfig
    "engine",  # LLMEngine, RequestOutput, EngineStats
    "model_runner",  # ModelRunner: a TP peer's side of the engine
    "parallel",  # TensorParallel, head_shard, split_range
    "step_channel",  # the leader-to-peers channel that KV commands ride
    "sampling",  # SamplingParams, RequestError, validate_request
    "timings",  # RequestTimings
    "tokenization",
    "detokenizer",
    "presets",  # resolve_model, check_model_spec
    "weights",  # check_checkpoint: the launcher checks a checkpoint before any rank loads it
}
PRODUCT = ("cluster", "decode_worker", "kvtransfer", "prefill_worker", "router")


def module_files() -> dict[str, Path]:
    """Every pdserve module by dotted name (bench included: it is importable as pdserve.bench)."""
    files = {PACKAGE: REPO / "__init__.py", f"{PACKAGE}.launch": REPO / "launch.py"}
    for folder in FOLDERS:
        for path in sorted((REPO / folder).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            files[".".join((PACKAGE, *parts))] = path
    return files


def _import_time_nodes(tree: ast.AST) -> Iterator[ast.AST]:
    """The nodes that run when the module is imported: everything but function bodies."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        yield node
        yield from _import_time_nodes(node)


def imports_of(name: str, path: Path, modules: set[str], functions: bool = False) -> set[str]:
    """The pdserve modules ``name`` imports when it is imported (``functions``: or ever)."""
    found = set()
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree) if functions else _import_time_nodes(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{name}: relative import (import as pdserve.*)"
            base = node.module or ""
            # ``from pdserve.engine import ops`` imports the module pdserve.engine.ops.
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        found.update(target for target in targets if target in modules and target != name)
    return found


def import_graph(functions: bool = False) -> dict[str, set[str]]:
    files = module_files()
    return {name: imports_of(name, path, set(files), functions) for name, path in files.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path that starts and ends at the same module, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for child in sorted(graph.get(node, ())):
            if state.get(child) == 1:
                return [*path[path.index(child) :], child]
            if child not in state and (cycle := visit(child)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)) is not None:
            return cycle
    return None


def test_the_graph_sees_the_imports_it_should() -> None:
    """The parser finds real edges, of every kind, and so can find a cycle among them."""
    graph = import_graph()
    assert len(graph) > 60
    assert "pdserve.prefill_worker.leader" in graph["pdserve.cluster.rank"]  # from a import B
    assert "pdserve.engine.ops" in graph["pdserve.engine.model_runner"]  # from package import module
    assert "pdserve.cluster.launcher" in graph["pdserve.launch"]  # inside try
    assert "pdserve.kvtransfer.torch_dist" not in graph["pdserve.kvtransfer.base"]  # inside a function
    assert "pdserve.kvtransfer.torch_dist" in import_graph(functions=True)["pdserve.kvtransfer.base"]


def test_find_cycle_finds_one() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_no_module_imports_itself_back() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


@pytest.mark.parametrize(
    ("folder", "reaches"),
    [("kernels", {"kernels"}), ("engine", {"engine", "kernels"}), ("kvtransfer", {"engine", "kernels", "kvtransfer"})],
)
def test_the_lower_layers_import_nothing_above_them(folder: str, reaches: set[str]) -> None:
    for module, imported in import_graph(functions=True).items():
        if module.startswith(f"{PACKAGE}.{folder}."):
            above = {m for m in imported if m.split(".")[1] not in reaches}
            assert not above, f"{module} imports {sorted(above)}"


@pytest.mark.parametrize("folder", PRODUCT)
def test_only_the_engine_imports_its_internals(folder: str) -> None:
    public = {f"{PACKAGE}.engine.{name}" for name in ENGINE_API}
    for module, imported in import_graph(functions=True).items():
        if module.startswith(f"{PACKAGE}.{folder}."):
            internal = {m for m in imported if m.startswith(f"{PACKAGE}.engine.") and m not in public}
            assert not internal, f"{module} imports engine internals {sorted(internal)}"


def test_the_router_imports_no_role_and_no_engine_beyond_requests_and_text() -> None:
    """The router package may use the contract, the cluster spec, the client library (its HTTP
    front end is a client of the router) and the CURVE keys both ends share, never a role,
    kvtransfer or the launcher; of the engine, requests, text and model names (the standalone
    HTTP front end resolves its ``--model``)."""
    allowed = ("sampling", "timings", "tokenization", "detokenizer", "presets")
    allowed_engine = {f"{PACKAGE}.engine.{name}" for name in allowed}
    for module, imported in import_graph(functions=True).items():
        if module.startswith(f"{PACKAGE}.router."):
            engine = {m for m in imported if m.startswith(f"{PACKAGE}.engine.")}
            assert engine <= allowed_engine, f"{module} imports {sorted(engine - allowed_engine)}"
            roles = {m for m in imported if m.split(".")[1] in ("prefill_worker", "decode_worker", "kvtransfer")}
            roles |= {
                m
                for m in imported
                if m.startswith(f"{PACKAGE}.cluster.")
                and m.split(".")[2] not in ("protocol", "config", "client", "auth")
            }
            assert not roles, f"{module} imports {sorted(roles)}"
