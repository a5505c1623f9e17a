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


# The layers, top first (docs/design.md, "The layout"): each a folder of src/relaytrain, and a
# module imports only from its own folder or from a folder below it.
LAYERS = ("commands", "planner", "run", "rollout", "strategies", "cost", "placement", "records", "data", "models",
          "objectives", "step", "dryrun", "schema", "utils")


def layer_of(module: str) -> int:
    """The module's layer: its folder's place in LAYERS (the package's own __init__, its version
    and nothing else: below all)."""
    parts = module.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 else len(LAYERS)


def test_the_folders_are_the_layers():
    """`ls src/relaytrain` shows the layers: every module sits in one of their folders."""
    loose = sorted(p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
    folders = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists())
    assert loose == [] and folders == sorted(LAYERS)


def test_no_import_climbs_to_a_higher_layer():
    known = modules()
    upward = [f"{name} -> {target}" for name, path in sorted(known.items())
              for target in sorted(imports_of(name, path, known)) if layer_of(target) < layer_of(name)]
    assert upward == []


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
    assert [q for q in quoted if not (q.startswith("commands/generate.py:") and q.endswith("'chat'"))] == []


# --------------------------------------------------------------------------- resolve once

# docs/design.md, "Resolve once" (issue 53): the config's walk from `train.run`, counted as
# tests/config_walk.py says, at most this long; and no longer than it stands today (the
# strategies, their cost models, and data's build and cache still take the config itself).
MAX_STOPS, MAX_CLIMBS = 40, 8
STANDS_AT = (40, 8)  # stops, climbs: lower it as the walk shortens (40: the reference pass of objective=dpo)


def test_the_config_walks_no_further_than_it_stands():
    """Read from the source, the config reaches no more modules, and comes back up no more
    often, than it does today (`python -m tests.config_walk` prints the route)."""
    from tests.config_walk import describe, walk

    route = walk()
    stops, climbs = STANDS_AT
    assert len(route.stops) <= stops and len(route.climbs) <= climbs, describe(route)
    assert route.route[0][0].qualname == "run" and any(f.qualname == "describe_run" for f, _ in route.route)


def test_the_config_walks_a_short_way():
    from tests.config_walk import describe, walk

    route = walk()
    assert len(route.stops) <= MAX_STOPS and len(route.climbs) <= MAX_CLIMBS, describe(route)


def test_the_walk_counts_each_return_to_a_module_and_each_climb():
    """The counting itself, on a route of four functions: run.train -> models -> run.train (a
    climb back) -> run.train (the same stop)."""
    from tests.config_walk import Def, Walk

    route = Walk(index=None)
    for module, name in (("relaytrain.run.train", "run"), ("relaytrain.models", "build_model"),
                         ("relaytrain.run.train", "Trainer.run"), ("relaytrain.run.train", "Trainer._step")):
        route.arrive(Def(module, name), "test")
    assert [m for m, _ in route.stops] == ["relaytrain.run.train", "relaytrain.models", "relaytrain.run.train"]
    assert route.climbs == ["relaytrain.models -> relaytrain.run.train.Trainer.run"]


# A registry's lookup by name: `objective(name)`, `family_spec(name)`, `family_of(hf_config)`,
# `source(name)`, `strategy_class(name)`, `Precision.from_name(name)`.
LOOKUPS = {("relaytrain.objectives", "objective"), ("relaytrain.models.family", "family_spec"),
           ("relaytrain.models.family", "family_of"), ("relaytrain.data.sources", "source"),
           ("relaytrain.strategies", "strategy_class"), ("relaytrain.step.precision", "Precision.from_name")}
# Where names are resolved: the run's names (run/resolve.py), a checkpoint's config into the model
# keys (models/pretrained.py), and the registries themselves.
RESOLUTION = {"relaytrain.run.resolve", "relaytrain.models.pretrained", "relaytrain.objectives",
              "relaytrain.models.family", "relaytrain.data.sources", "relaytrain.strategies",
              "relaytrain.step.precision"}
# Lookups outside resolution, by module (how many). Still to go: each is handed the config rather
# than what the run resolved, and asks `run.resolve.choose` / `RunSpec` (or receives its objects)
# once that changes. To stay: the help's and the planner's, last below.
STILL_LOOKED_UP = {
    # given only a config (tests, scripts, notebooks, the planner's estimates): the run passes the resolved ones
    "relaytrain.models": 2, "relaytrain.data": 3,
    # a strategy is built from the config alone: handed the RunSpec (its precision, its family), these go
    "relaytrain.strategies.base": 1, "relaytrain.strategies.l2l_cost": 2, "relaytrain.strategies.sequence_parallel": 1,
    "relaytrain.strategies.whole_model": 1,
    "relaytrain.cost.formulas": 1, "relaytrain.cost.profile": 3, "relaytrain.cost.work": 2,
    # `train --help` lists the chosen strategy's keys, whatever the config's other names say
    "relaytrain.commands.help": 1,
    # the strategies the planner tries, by the names it enumerates (no config's name)
    "relaytrain.planner.candidates": 2, "relaytrain.planner.plan": 2,
}


def lookups_by_name() -> dict[str, int]:
    """How many calls of a registry's lookup each module outside RESOLUTION makes."""
    from tests.config_walk import Def, Index

    index, wanted, found = Index(), {Def(*lookup) for lookup in LOOKUPS}, {}
    for name, tree in index.trees.items():
        calls = sum(isinstance(node, ast.Call) and index.callee(name, node.func) in wanted for node in ast.walk(tree))
        if calls and name not in RESOLUTION:
            found[name] = calls
    return found


def test_names_are_looked_up_only_where_they_are_resolved():
    """The checks, the data sources and the model builder receive the family, objective, source,
    strategy and precision `run.resolve` found: no lookup by name outside resolution but those
    listed as still to go (a new one fails, and so does one that went without leaving the list)."""
    assert lookups_by_name() == STILL_LOOKED_UP


def test_the_lookup_scan_sees_a_lookup_through_its_class():
    """`Precision.from_name(...)` in run/resolve.py is the registry's method, found through the class imported."""
    from tests.config_walk import Def, Index

    call = ast.parse("Precision.from_name(str(cfg.precision.name))", mode="eval").body
    assert Index().callee("relaytrain.run.resolve", call.func) == Def("relaytrain.step.precision", "Precision.from_name")


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
