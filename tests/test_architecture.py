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


# --------------------------------------------------------------------------- the config's walk

MAX_STAYS, MAX_CLIMBS = 40, 8  # docs/design.md, "Resolve once"


def is_whole_config(value) -> bool:
    """The run's whole config (a root DictConfig with a strategy), not one of its sections."""
    from omegaconf import DictConfig

    return isinstance(value, DictConfig) and value._get_parent() is None and "strategy" in value


def walk_of_the_config(cfg, run_dir) -> list[tuple[str, str, bool]]:
    """Every relaytrain function that receives the whole config during `train.run(cfg)`, first
    call first, as (module, function, climb): a climb is a call back into a module that an
    outer holder of the config, below the caller, is in (a callback up the chain)."""
    import sys

    from relaytrain import train

    walk: dict[tuple[str, str], bool] = {}

    def holds_config(frame) -> bool:
        code = frame.f_code
        return frame.f_globals.get("__name__", "").startswith("relaytrain") and any(
            is_whole_config(frame.f_locals.get(arg)) for arg in code.co_varnames[:code.co_argcount])

    def on_call(frame, event, _):  # a global trace function: called on Python calls only, no line tracing
        if not holds_config(frame):
            return None
        holders, outer = [], frame.f_back
        while outer is not None:
            if holds_config(outer):
                holders.append(outer.f_globals["__name__"])
            outer = outer.f_back
        module = frame.f_globals["__name__"]
        climb = bool(holders) and module != holders[0] and module in holders[1:]
        walk.setdefault((module, frame.f_code.co_qualname), climb)
        return None

    sys.settrace(on_call)
    try:
        train.run(cfg, run_dir, quiet=True)
    finally:
        sys.settrace(None)
    return [(module, function, climb) for (module, function), climb in walk.items()]


def test_the_config_is_resolved_once_and_walks_a_short_way(tmp_path):
    """A decoder fine-tuned with LoRA under l2l (the richest one-process path): the names are
    looked up once (run_spec.describe_run) and the whole config visits few functions."""
    from relaytrain.compose import compose_config

    cfg = compose_config(["strategy=l2l", "model=llama_tiny", "adapter=lora", "train.steps=1", "train.device=cpu"])
    walk = walk_of_the_config(cfg, tmp_path)
    assert ("relaytrain.run_spec", "describe_run", False) in walk
    stays = [f"{module}.{function}" for module, function, _ in walk]
    climbs = [f"{module}.{function}" for module, function, climb in walk if climb]
    assert len(stays) <= MAX_STAYS, f"{len(stays)} functions receive the whole config: {stays}"
    assert len(climbs) <= MAX_CLIMBS, f"{len(climbs)} calls climb back up: {climbs}"
    assert not any("registry" in s or s.endswith((".strategy_class", ".family_spec", ".source")) for s in stays)


def test_no_file_over_500_lines_and_no_class_over_300():
    """Schedules as data aside (strategies/pipeline/schedule.py: tables of the published schedules)."""
    data_files = {"relaytrain.strategies.pipeline.schedule"}
    long_files, long_classes = [], []
    for name, path in modules().items():
        text = path.read_text()
        if name not in data_files and len(text.splitlines()) > 500:
            long_files.append(f"{name}: {len(text.splitlines())}")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > 300:
                long_classes.append(f"{name}.{node.name}: {node.end_lineno - node.lineno + 1}")
    assert not long_files and not long_classes, long_files + long_classes
