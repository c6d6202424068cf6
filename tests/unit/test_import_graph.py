"""Imports run one way (issue 43): no circle among the project's modules, `TYPE_CHECKING` imports included, and the
core's bookkeeping (scheduler, block manager, sequences, sampling parameters) and the Serve modules load no torch when
imported. Read
from the source with `ast`, so nothing is imported to check it."""
import ast
import graphlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("engine", "serve_app")
FRONT_END_TEXT = ("engine.detokenizer", "engine.input_processor", "engine.output_processor", "engine.chat",
                  "engine.tool_calls", "tokenizers")  # text in, text out: the front end's, never the core's
TORCH_FREE = ("engine.scheduler", "engine.block_manager", "engine.sequence", "engine.sampling_params",
              "engine.config", "engine.errors", "engine.speculative", "engine.request_inbox", "engine.tool_calls",
              "engine.admission", "engine.engine_stats", "engine.thinking_budget", "engine.repetition",
              "engine.prompt_part", "serve_app.ingress", "serve_app.model_front", "serve_app.replica", "serve_app.protocol")


def project_modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imported_names(module: str, path: Path, at_import_only: bool) -> set[str]:
    """Every module `module` imports, absolute names; with `at_import_only`, only what runs when it is imported (not
    function bodies, not `if TYPE_CHECKING:` blocks)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: set[str] = set()
    nodes = list(ast.iter_child_nodes(ast.parse(path.read_text())))
    while nodes:
        node = nodes.pop()
        if at_import_only and (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) or _type_checking(node)):
            continue
        nodes.extend(ast.iter_child_nodes(node))
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names.update(f"{base}.{alias.name}" for alias in node.names)
            names.add(base)
    return names


def _type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def import_graph(at_import_only: bool) -> dict[str, set[str]]:
    """Project module -> the project modules and the outside top-level packages it imports."""
    modules = project_modules()
    graph = {}
    for module, path in modules.items():
        names = imported_names(module, path, at_import_only)
        graph[module] = {n for n in names if n in modules} | {n.split(".")[0] for n in names if n.split(".")[0] not in PACKAGES}
    return graph


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle among the graph's own modules (its outside packages left out), or None."""
    try:
        graphlib.TopologicalSorter({m: names & graph.keys() for m, names in graph.items()}).prepare()
    except graphlib.CycleError as circle:
        return circle.args[1]
    return None


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        node = todo.pop()
        if node not in seen:
            seen.add(node)
            todo.extend(graph.get(node, ()))
    return seen


def test_no_module_imports_itself_back_type_checking_imports_included():
    assert cycle(import_graph(at_import_only=False)) is None


def test_the_check_sees_a_circle():
    found = cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a", "torch"}})
    assert found is not None and set(found) == {"a", "b", "c"}


def test_the_cores_bookkeeping_loads_no_torch():
    graph = import_graph(at_import_only=True)
    for module in TORCH_FREE:
        assert "torch" not in reachable(graph, module), module


def test_the_torch_check_sees_torch_through_the_model_runner():
    assert "torch" in reachable(import_graph(at_import_only=True), "engine.model_runner")


def test_the_core_reaches_none_of_the_front_ends_text_code_function_level_imports_included():
    """The core process takes token ids and returns token ids: tokenizing, detokenizing and stop strings are the
    front end's. Its one tokenizer, loaded through transformers, serves a grammar's vocabulary and the EOS ids."""
    graph = import_graph(at_import_only=False)
    for core in ("engine.core_process", "engine.llm_engine"):
        assert not set(FRONT_END_TEXT) & reachable(graph, core), core
    assert {"engine.output_processor", "tokenizers"} <= reachable(graph, "engine.async_engine")  # the check sees them
