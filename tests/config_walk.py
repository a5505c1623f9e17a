"""The run config's walk, read from the source the way a reader follows it.

Start at `relaytrain.run.train.run(cfg, ...)` and follow every call, in every branch (both arms
of an `if`, every `except`, the lambdas written in a function), that hands the config on: the
whole config, a section of it (`cfg.model`; a name bound to `cfg.data`; `cfg.data.mix` and its
parts), or an object that holds one (a method of an object whose constructor kept the config in
`self.<attr>`, when that method or one it calls on `self` reads the attribute). A plain value
(`cfg.data.seq_len`, `str(cfg.model.task)`) is no part of the config: passing it is what resolving
the config early is for.

- The **route** is the functions the config reaches, in the order a depth-first reading first
  reaches them (each function once: a reader who has read it does not read it again).
- A **stop** is each arrival of the route in a module: its modules in order, a module counted
  again each time the route comes back to it (consecutive functions of one module are one stop).
- A **climb** is a step of the route into a module of a higher layer (tests/test_architecture.py's
  `LAYERS`, top first) than the one it was in: the next function the config reaches, after a call went down, sits higher.

What the reading resolves: a name defined in the module or imported (re-exports followed), a
module's function (`checkpoint.latest`), a class's constructor (its `__init__`, looked up
through its relaytrain bases) and methods (`cls.describe_process`, `self._step`,
`super().check`), and the type of a value from what the source says of it: a parameter's or a
return's annotation, a dataclass field's, `self.x = ...` in a method, a call to a class. A call
through a registry's declared type (`spec.strategy`: `type[Strategy]`; a `type[DataSource]`)
reads the declared class's method, the contract a reader opens; the registered classes'
overrides are not followed. A call whose callee no annotation or assignment names (a parameter
holding a function: `describe(rank)`) is listed as unresolved, not followed, unless the function
was passed in by a followed call (`launch(train_process, cfg, ...)` calls `entry(cfg, ...)`).
Loop variables, containers and `getattr` are not typed.

`python -m tests.config_walk` prints the route, its stops and climbs.
"""

from __future__ import annotations

import ast
import builtins
import dataclasses
from dataclasses import dataclass, field

from tests.test_architecture import PACKAGE, layer_of, module_name

START = ("relaytrain.run.train", "run")
SCHEMA = "relaytrain.schema.config"  # a value annotated with one of its *Config classes is the config

# --------------------------------------------------------------------------- what a value is


@dataclass(frozen=True)
class Config:
    kind: str  # the whole config ("whole"), one section ("section"), a list of sections ("sections")


@dataclass(frozen=True)
class Module:
    name: str


@dataclass(frozen=True)
class Def:
    module: str
    qualname: str  # a function or class defined in the package (a method: `Class.method`)


@dataclass(frozen=True)
class Instance:
    cls: Def


@dataclass(frozen=True)
class Bound:
    function: Def  # a method reached through an object or a class (`self`: what it is bound to)
    self: object


@dataclass(frozen=True)
class Several:
    values: tuple  # a tuple of values (a `tuple[...]` annotation), bound element by element


def nested_sections() -> set[str]:
    """Keys of a section that are sections themselves (`data.mix`: a list of MixConfig)."""
    from relaytrain.schema import config

    found = set()
    for section in dataclasses.fields(config.RelayTrainConfig):
        schema = getattr(config, str(section.type), None)
        for f in dataclasses.fields(schema) if dataclasses.is_dataclass(schema) else ():
            if "Config" in str(f.type):
                found.add(f.name)
    return found


# --------------------------------------------------------------------------- the package's source


class Index:
    """Every module's syntax tree, its definitions and what its names import."""

    def __init__(self):
        self.paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
        self.trees = {name: ast.parse(path.read_text()) for name, path in self.paths.items()}
        self.defs = {name: self._definitions(tree) for name, tree in self.trees.items()}
        self.imports = {name: self._imported(name, tree) for name, tree in self.trees.items()}

    @staticmethod
    def _definitions(tree) -> dict[str, ast.AST]:
        found = {}
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                found[node.name] = node
            if isinstance(node, ast.ClassDef):
                found.update({f"{node.name}.{n.name}": n for n in node.body if isinstance(n, ast.FunctionDef)})
        return found

    def _imported(self, module: str, scope) -> dict[str, str]:
        """Local name -> dotted target, for every import in `scope` (a module or a function)."""
        package = module if self.paths[module].name == "__init__.py" else module.rpartition(".")[0]
        found = {}
        for node in ast.walk(scope):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    found[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else alias.name.split(".")[0]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                for alias in node.names:
                    found[alias.asname or alias.name] = f"{base}.{alias.name}"
        return found

    def resolve(self, dotted: str, depth: int = 0):
        """A dotted name as a Module or Def of the package, None outside it."""
        if dotted in self.paths:
            return Module(dotted)
        module, _, name = dotted.rpartition(".")
        if module not in self.paths or depth > 8:
            return None
        if name in self.defs[module]:
            return Def(module, name)
        target = self.imports[module].get(name)
        return self.resolve(target, depth + 1) if target else None

    def node(self, d: Def):
        return self.defs[d.module].get(d.qualname)

    def bases(self, cls: Def) -> list[Def]:
        found = []
        for base in self.node(cls).bases:
            target = self.global_value(cls.module, base)
            if isinstance(target, Def) and isinstance(self.node(target), ast.ClassDef):
                found.append(target)
        return found

    def global_value(self, module: str, expr):
        """A module-level name or dotted attribute (`checkpoint.latest`) as a Module or Def."""
        if isinstance(expr, ast.Name):
            if expr.id in self.defs[module]:
                return Def(module, expr.id)
            target = self.imports[module].get(expr.id)
            return self.resolve(target) if target else None
        if isinstance(expr, ast.Attribute):
            base = self.global_value(module, expr.value)
            return self.resolve(f"{base.name}.{expr.attr}") if isinstance(base, Module) else None
        return None

    def callee(self, module: str, func) -> Def | Module | None:
        """What a call's function names at module level: a function, a class, or a class's method
        (`Precision.from_name`)."""
        found = self.global_value(module, func)
        if found is None and isinstance(func, ast.Attribute):
            owner = self.global_value(module, func.value)
            if isinstance(owner, Def) and isinstance(self.node(owner), ast.ClassDef):
                return self.member(owner, func.attr)
        return found

    def member(self, cls: Def, name: str) -> Def | None:
        """The method `name` of `cls` or of its nearest relaytrain base that has one."""
        return self._nearest(cls, lambda c: Def(c.module, f"{c.qualname}.{name}")
                             if f"{c.qualname}.{name}" in self.defs[c.module] else None)

    def _nearest(self, cls: Def, find, seen=()):
        """`find(cls)`, or else the same of its nearest relaytrain base that answers."""
        found = find(cls)
        for base in self.bases(cls) if found is None else ():
            found = self._nearest(base, find, (*seen, cls)) if base not in seen else None
            if found is not None:
                break
        return found

    def annotation(self, module: str, expr):
        """The value an annotation describes: `X` an instance (a schema section: the config),
        `type[X]` the class, `tuple[X, Y]` both (None when it names nothing of the package)."""
        if expr is None:
            return None
        if isinstance(expr, ast.Constant) and isinstance(expr.value, str):
            try:
                expr = ast.parse(expr.value, mode="eval").body
            except SyntaxError:
                return None
        if isinstance(expr, ast.BinOp):  # X | None
            return self.annotation(module, expr.left) or self.annotation(module, expr.right)
        if isinstance(expr, ast.Subscript) and isinstance(expr.value, ast.Name) and expr.value.id == "type":
            target = self.global_value(module, expr.slice)
            return target if isinstance(target, Def) else None
        if isinstance(expr, ast.Subscript) and isinstance(expr.value, ast.Name) and expr.value.id == "ClassVar":
            return self.annotation(module, expr.slice)
        if isinstance(expr, ast.Subscript) and isinstance(expr.value, ast.Name) and expr.value.id == "tuple":
            parts = expr.slice.elts if isinstance(expr.slice, ast.Tuple) else [expr.slice]
            return Several(tuple(self.annotation(module, part) for part in parts))
        target = self.global_value(module, expr)
        if isinstance(target, Def) and target.module == SCHEMA and target.qualname.endswith("Config"):
            return Config("whole" if target.qualname == "RelayTrainConfig" else "section")  # typed as the config
        return Instance(target) if isinstance(target, Def) and isinstance(self.node(target), ast.ClassDef) else None

    def class_attribute(self, cls: Def, name: str):
        """What a class body annotates `name` as (a dataclass field, a ClassVar), through its bases."""
        return self._nearest(cls, lambda c: next((self.annotation(c.module, item.annotation) for item in self.node(c).body
                                                  if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
                                                  and item.target.id == name), None))


# --------------------------------------------------------------------------- the walk


@dataclass
class Walk:
    """The route (modules in order, with the call that arrived in each), read from START."""

    index: Index
    route: list[tuple[Def, str]] = field(default_factory=list)  # (function, the caller that reached it first)
    unresolved: list[str] = field(default_factory=list)
    read: set = field(default_factory=set)  # (function, what its parameters held) already expanded
    returns_config: dict = field(default_factory=dict)  # function -> the share of the config it returns
    attributes: dict = field(default_factory=dict)  # (class, attribute) -> value assigned in a method
    sections: set = field(default_factory=nested_sections)

    @property
    def stops(self) -> list[tuple[str, str]]:
        """(module, the function the route arrived at), each arrival of the route in a module."""
        found: list[tuple[str, str]] = []
        for function, _ in self.route:
            if not found or found[-1][0] != function.module:
                found.append((function.module, function.qualname))
        return found

    @property
    def climbs(self) -> list[str]:
        stops = self.stops
        return [f"{stops[i - 1][0]} -> {module}.{function}" for i, (module, function) in enumerate(stops)
                if i and layer_of(module) < layer_of(stops[i - 1][0])]

    def arrive(self, function: Def, caller: str) -> None:
        if all(function != reached for reached, _ in self.route):
            self.route.append((function, caller))

    def read_function(self, function: Def, env: dict) -> None:
        key = (function, tuple(sorted((k, repr(v)) for k, v in env.items() if v is not None)))
        if key in self.read:
            return
        self.read.add(key)
        Reader(self, function, env).read()

    def uses_held_config(self, method: Def, seen=()) -> bool:
        """Whether `method` reads an attribute of `self` that holds the config, or calls a method
        of `self` that does."""
        owner = Def(method.module, method.qualname.rpartition(".")[0])
        held = {attr for (cls, attr), value in self.attributes.items() if isinstance(value, Config)
                and (cls == owner or cls in self.index.bases(owner))}
        for node in ast.walk(self.index.node(method)):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
                if node.attr in held:
                    return True
                called = self.index.member(owner, node.attr)
                if called and called not in seen and called != method and self.uses_held_config(called, (*seen, method)):
                    return True
        return False


class Reader(ast.NodeVisitor):
    """One function's body, in source order: its bindings, and the calls that pass the config on."""

    def __init__(self, walk: Walk, function: Def, env: dict):
        self.walk, self.index, self.function, self.env = walk, walk.index, function, dict(env)
        self.node = walk.index.node(function)
        self.module = function.module
        self.owner = Def(function.module, function.qualname.rpartition(".")[0]) if "." in function.qualname else None
        self.local_imports = self.index._imported(self.module, self.node)

    def read(self) -> None:
        for statement in self.node.body:
            self.visit(statement)

    # -- values ----------------------------------------------------------------------------------
    def value(self, expr):
        if isinstance(expr, ast.Name):
            if expr.id in self.env:
                return self.env[expr.id]
            if expr.id in self.local_imports:
                return self.index.resolve(self.local_imports[expr.id])
            return self.index.global_value(self.module, expr)
        if isinstance(expr, ast.Attribute):
            return self.attribute(self.value(expr.value), expr.attr)
        if isinstance(expr, ast.Subscript):
            base = self.value(expr.value)
            return Config("section") if isinstance(base, Config) and base.kind in ("whole", "sections") else None
        if isinstance(expr, ast.Call):
            return self.result(expr)
        if isinstance(expr, ast.IfExp):
            return self.value(expr.body) or self.value(expr.orelse)
        if isinstance(expr, ast.BoolOp):
            return next((v for v in map(self.value, expr.values) if v is not None), None)
        if isinstance(expr, ast.NamedExpr):
            return self.value(expr.value)
        return None

    def attribute(self, base, name: str):
        if isinstance(base, Config):
            if base.kind == "whole":
                return Config("section")
            return Config("sections") if base.kind == "section" and name in self.walk.sections else None
        if isinstance(base, Module):
            return self.index.resolve(f"{base.name}.{name}")
        cls = base.cls if isinstance(base, Instance) else base
        if not (isinstance(cls, Def) and isinstance(self.index.node(cls), ast.ClassDef)):
            return None
        method = self.index.member(cls, name)
        if method:
            return Bound(method, base)
        for owner in (cls, *self.index.bases(cls)):
            if (owner, name) in self.walk.attributes:
                return self.walk.attributes[owner, name]
        return self.index.class_attribute(cls, name)

    def result(self, call: ast.Call):
        """What a call gives back: the config (a function seen to return what it was given, or a
        copy), an instance of a class called, or what the function's annotation says."""
        if isinstance(call.func, ast.Attribute) and call.func.attr in ("deepcopy", "copy") and call.args:
            return self.value(call.args[0])
        if isinstance(call.func, ast.Name) and call.func.id == "super" and self.owner:
            return next(iter(self.index.bases(self.owner)), None)  # its first base, as the class
        callee = self.value(call.func)
        function = callee.function if isinstance(callee, Bound) else callee
        if not isinstance(function, Def):
            return None
        node = self.index.node(function)
        if isinstance(node, ast.ClassDef):
            return Instance(function)
        if function in self.walk.returns_config and self.passes_config(call):
            return self.walk.returns_config[function]
        return self.index.annotation(function.module, node.returns)

    def passes_config(self, call: ast.Call) -> bool:
        args = [a.value if isinstance(a, ast.Starred) else a for a in call.args] + [k.value for k in call.keywords]
        return any(isinstance(self.value(a), Config) for a in args)

    # -- bindings --------------------------------------------------------------------------------
    def bind(self, target, value, expr=None) -> None:
        if isinstance(target, ast.Name):
            self.env[target.id] = value
        elif isinstance(target, (ast.Tuple, ast.List)):
            parts = expr.elts if isinstance(expr, (ast.Tuple, ast.List)) and len(expr.elts) == len(target.elts) else None
            several = value.values if isinstance(value, Several) and len(value.values) == len(target.elts) else None
            for i, element in enumerate(target.elts):
                if parts:
                    self.bind(element, self.value(parts[i]), parts[i])
                else:
                    self.bind(element, several[i] if several else None)
        elif isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
            if self.owner is not None and value is not None:
                self.walk.attributes.setdefault((self.owner, target.attr), value)

    def visit_Assign(self, node: ast.Assign) -> None:
        self.visit(node.value)
        for target in node.targets:
            self.bind(target, self.value(node.value), node.value)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        if node.value is not None:
            self.visit(node.value)
            self.bind(node.target, self.value(node.value) or self.index.annotation(self.module, node.annotation))

    def visit_For(self, node: ast.For) -> None:
        self.visit(node.iter)
        self.bind(node.target, None)
        for statement in node.body + node.orelse:
            self.visit(statement)

    def visit_withitem(self, node: ast.withitem) -> None:
        self.visit(node.context_expr)
        self.bind(node.optional_vars, None)

    def visit_FunctionDef(self, node) -> None:  # a nested function or a lambda: the config by closure
        self.env.update({arg.arg: None for arg in node.args.args})
        for statement in node.body if isinstance(node.body, list) else [node.body]:
            self.visit(statement)

    visit_Lambda = visit_FunctionDef

    def visit_Return(self, node: ast.Return) -> None:
        if node.value is not None:
            self.visit(node.value)
            if isinstance(self.value(node.value), Config):
                self.walk.returns_config.setdefault(self.function, self.value(node.value))

    # -- calls -----------------------------------------------------------------------------------
    def visit_Call(self, node: ast.Call) -> None:
        self.generic_visit(node)
        callee = self.value(node.func)
        target, bound = self.target(callee)
        passes = self.passes_config(node)
        if target is not None and not passes and bound is not None and not isinstance(bound, Def):
            passes = self.index.node(target) is not None and self.walk.uses_held_config(target)
        if not passes:
            return
        if target is None or self.index.node(target) is None:
            if callee is None and self.dynamic(node.func):
                self.walk.unresolved.append(f"{self.module}.{self.function.qualname}: {ast.unparse(node.func)}(...)")
            return
        self.follow(node, target, bound)

    def target(self, callee) -> tuple[Def | None, object]:
        """The function a call runs (a class: its `__init__`) and what its first parameter is bound to."""
        if isinstance(callee, Bound):
            node = self.index.node(callee.function)
            decorators = {d.id for d in node.decorator_list if isinstance(d, ast.Name)}
            if "staticmethod" in decorators:
                return callee.function, None
            owner = callee.self
            if "classmethod" in decorators and isinstance(owner, Instance):
                owner = owner.cls
            return callee.function, owner
        if isinstance(callee, Def) and isinstance(self.index.node(callee), ast.ClassDef):
            init = self.index.member(callee, "__init__")
            return (init, Instance(callee)) if init else (None, None)
        return (callee, None) if isinstance(callee, Def) else (None, None)

    def dynamic(self, func) -> bool:
        """A callee named by a local name (a parameter holding a function), not a builtin or a library's."""
        root = func
        while isinstance(root, (ast.Attribute, ast.Call, ast.Subscript)):
            root = root.func if isinstance(root, ast.Call) else root.value
        if not isinstance(root, ast.Name) or hasattr(builtins, root.id):
            return False
        return root.id in self.env and not (root.id in self.local_imports or root.id in self.index.imports[self.module])

    def follow(self, call: ast.Call, target: Def, bound) -> None:
        node = self.index.node(target)
        params = [a.arg for a in node.args.posonlyargs + node.args.args]
        env = {}
        if bound is not None and params:
            env[params[0]], params = bound, params[1:]
        for name, arg in zip(params, call.args, strict=False):
            env[name] = None if isinstance(arg, ast.Starred) else self.value(arg)
        for keyword in call.keywords:
            if keyword.arg:
                env[keyword.arg] = self.value(keyword.value)
        for arg in node.args.posonlyargs + node.args.args + node.args.kwonlyargs:
            if env.get(arg.arg) is None:
                env[arg.arg] = self.index.annotation(target.module, arg.annotation)
        self.walk.arrive(target, f"{self.module}.{self.function.qualname}")
        self.walk.read_function(target, env)


def walk() -> Walk:
    """The config's route from `relaytrain.run.train.run`."""
    index = Index()
    start = Def(*START)
    route = Walk(index)
    route.arrive(start, "start")
    env = {a.arg: index.annotation(start.module, a.annotation) for a in index.node(start).args.args}
    route.read_function(start, {**env, "cfg": Config("whole")})
    return route


def describe(route: Walk) -> str:
    """The route, one function a line (a new stop numbered, a climb marked ^), then its totals."""
    lines, stop, previous = [], 0, None
    for function, caller in route.route:
        arrives = function.module != previous
        stop += arrives
        climb = arrives and previous is not None and layer_of(function.module) < layer_of(previous)
        mark = f"{stop:3} {'^' if climb else ' '}" if arrives else "     "
        lines.append(f"{mark} {function.module}.{function.qualname}  <- {caller}")
        previous = function.module
    modules = len({module for module, _ in route.stops})
    lines.append(f"{len(route.stops)} stops in {modules} modules, {len(route.climbs)} climbs, {len(route.route)} functions")
    if route.unresolved:
        lines.append("not followed (a callee no annotation names): " + "; ".join(route.unresolved))
    return "\n".join(lines)


if __name__ == "__main__":
    print(describe(walk()))
