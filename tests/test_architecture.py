"""The layout stays as docs/design.md draws it: imports point one way, and only the strategies
know strategies by name (the models model families, the objectives objectives, data/ the
data sources).

Both checks read the source (`ast`), counting every import: at the top of a module, inside a
function, under `if TYPE_CHECKING`. A cycle among `src/relaytrain` modules, or a string
literal naming a strategy or schedule outside `strategies/`, fails with the places to look.
"""

from __future__ import annotations

import ast
from pathlib import Path

import relaytrain
from relaytrain.data.sources import source_names
from relaytrain.models import families
from relaytrain.objectives import objectives
from relaytrain.strategies import choices
from relaytrain.strategies.pipeline.schedule import schedules

PACKAGE = Path(relaytrain.__file__).parent


def module_name(path: Path) -> str:
    parts = ["relaytrain", *path.relative_to(PACKAGE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in PACKAGE.rglob("*.py")}


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The relaytrain modules `name` imports anywhere in its source (a name imported from a
    package counts as that package's module, or as the submodule it names)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_imports_point_one_way():
    known = modules()
    graph = {name: imports_of(name, path, known) for name, path in known.items()}
    assert cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle_through_a_function_level_import():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    source = imports_of("relaytrain.planner.estimate", PACKAGE / "planner" / "estimate.py", modules())
    assert "relaytrain.planner.plan" in source  # the estimate uses the planner, and nothing below calls back


def quoted_outside(names: set[str], folder: str, *excepted: str) -> list[str]:
    """Every string literal equal to one of `names` in a module outside PACKAGE/folder (and the
    `excepted` folders)."""
    quoted = []
    for path in PACKAGE.rglob("*.py"):
        if {folder, *excepted} & set(path.relative_to(PACKAGE).parts):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in names:
                quoted.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {node.value!r}")
    return quoted


def test_only_the_strategies_name_strategies():
    assert quoted_outside(set(choices()) | set(schedules()), "strategies") == []


def test_only_the_models_name_model_families():
    """A family is asked (`family_spec`, `family_of`), never branched on by name outside `models/`."""
    assert quoted_outside(set(families()), "models") == []


def test_only_the_objectives_name_objectives():
    """An objective is asked (`objective(name).classifies`, `.predicts_next_token`, ...), never
    branched on by name outside `objectives/` (the data asks through `data/labels.py`)."""
    assert quoted_outside(set(objectives()), "objectives") == []


def test_only_data_names_data_sources():
    """A source is asked (`source(name).check`, `.load`, `.benchmark_task`), never branched on by
    name outside `data/`. The one word shared by chance is `relaytrain generate`'s own `chat` key."""
    quoted = quoted_outside(set(source_names()), "data")
    assert [q for q in quoted if not (q.startswith("generate.py:") and q.endswith("'chat'"))] == []
