"""The package's layers import one way: the engine imports no kind, no study and not the registry; a kind imports
no study; a study imports no kind (it reaches a kind through a mixer and the kind's declarations); a kind imports no
other kind's private helper (the maths several kinds share live in `kinds/shared/`: `delta_rule`, `ssm`, `conv`,
which a kind imports by their public names, and which are not kinds); no module uses another module's underscore
names (a kind's adapter, `Kind.adapter`, is public); only `engine/tracing.py` asks whether torch.compile traces; every
path is one runner; no class over 240 statements, no function over 70 (docs/architecture.md). Read from the source,
so an import inside a function counts too."""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "recurrent_hooks"


def _imports(path: pathlib.Path, runtime: bool = False) -> set[str]:
    """The modules below recurrent_hooks that the file imports, as dotted paths ("engine.declare.kernels",
    "registry"); `runtime`: not those under `if TYPE_CHECKING:`."""
    here = path.relative_to(PACKAGE).with_suffix("").parts[:-1]  # the file's package below recurrent_hooks
    return _imports_of(ast.parse(path.read_text(), str(path)), here, runtime)


def _imports_of(tree: ast.AST, here: tuple[str, ...], runtime: bool = False) -> set[str]:
    found = set()
    skipped = {
        id(inner)
        for node in ast.walk(tree)
        if runtime and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for inner in ast.walk(node)
        if inner is not node
    }
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(here[: len(here) - node.level + 1])
                target = [*base, *(node.module.split(".") if node.module else [])]
                names = [target] if node.module else [[*target, alias.name] for alias in node.names]
            elif node.module and node.module.split(".")[0] == "recurrent_hooks":
                names = [node.module.split(".")[1:]]
            else:
                continue
            found.update(".".join(name) for name in names if name)
        elif isinstance(node, ast.Import):
            found.update(
                ".".join(alias.name.split(".")[1:])
                for alias in node.names
                if alias.name.split(".")[0] == "recurrent_hooks" and "." in alias.name
            )
    return found


def _layer(module: str) -> str:
    return module.split(".")[0]


FORBIDDEN = {
    "engine": {"kinds", "studies", "registry", "toys", "extend", "demo", "plots"},
    "kinds": {"studies", "registry", "toys", "extend", "demo", "plots"},
    "studies": {"kinds", "registry", "toys", "extend", "demo"},
}
FILES = sorted(p for layer in FORBIDDEN for p in (PACKAGE / layer).rglob("*.py"))


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_run_one_way(path):
    layer = path.relative_to(PACKAGE).parts[0]
    wrong = sorted(m for m in _imports(path) if _layer(m) in FORBIDDEN[layer])
    assert not wrong, f"recurrent_hooks/{path.relative_to(PACKAGE)} ({layer}) imports {wrong}"


def test_the_layers_are_there_and_the_check_sees_imports():
    """Each layer has modules, and the import reader finds a relative import across layers (so the test can fail)."""
    for layer in ("engine", "kinds", "studies"):
        assert len(list((PACKAGE / layer).rglob("*.py"))) > 2, f"recurrent_hooks/{layer} has no modules"
    assert "engine.declare.kernels" in _imports(PACKAGE / "kinds" / "gated_delta_net.py")
    assert "engine.handle.mixer" in _imports(PACKAGE / "studies" / "effective_attention.py")
    assert {"kinds.gated_delta_net", "engine.binding.registry"} <= _imports(PACKAGE / "registry.py")


def _private_names_from_siblings(path: pathlib.Path) -> list[str]:
    """`module.name` for every underscore name the file imports from another module of the package by a relative
    import (a sibling kind, a shared module, the engine)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level and node.module:
            found += [f"{node.module}.{alias.name}" for alias in node.names if alias.name.startswith("_")]
    return found


KINDS = sorted(p for p in (PACKAGE / "kinds").glob("*.py") if p.name != "__init__.py")  # one module per kind
SHARED = sorted(p for p in (PACKAGE / "kinds" / "shared").glob("*.py") if p.name != "__init__.py")  # not kinds


@pytest.mark.parametrize("path", KINDS + SHARED, ids=lambda p: str(p.relative_to(PACKAGE / "kinds")))
def test_a_kind_imports_no_private_helper_of_another_kind(path):
    wrong = _private_names_from_siblings(path)
    assert not wrong, f"recurrent_hooks/{path.relative_to(PACKAGE)} imports private helpers of other modules: {wrong}"


def test_the_private_import_check_sees_one(tmp_path):
    (tmp_path / "k.py").write_text("from .other import _helper as helper, public\nfrom ..shared.ssm import _step\n")
    assert _private_names_from_siblings(tmp_path / "k.py") == ["other._helper", "shared.ssm._step"]


def test_the_kinds_are_the_modules_of_kinds_and_the_shared_maths_are_none():
    """Every mixer kind is declared in a module of `kinds/` (its tests are tests/kinds/test_<module>.py, where
    tests/helpers/_contract.py `reading_of` finds its contract reading by that name); `kinds/shared/` declares none
    and imports no kind: it holds the maths several kinds share."""
    import recurrent_hooks as rh

    def subclasses(cls):
        return [cls, *(sub for child in cls.__subclasses__() for sub in subclasses(child))]

    kinds = {p.stem for p in KINDS}
    declared = {
        kind.__module__
        for kind in subclasses(rh.RecurrentMixer)
        if kind.__module__.startswith("recurrent_hooks.kinds.")
    }
    assert {module.split(".", 2)[2] for module in declared} == kinds, sorted(declared)
    wrong = {
        str(path.relative_to(PACKAGE)): found
        for path in SHARED
        if (found := sorted(m for m in _imports(path) if m.split(".")[:2][-1] in kinds))
    }
    assert SHARED and not wrong, f"the shared maths import kinds: {wrong}"


def _private_uses(path: pathlib.Path, defined: dict[str, set[str]]) -> list[str]:
    """`name (line)` for every underscore name of another module of the package that the file uses: imported, or
    read as an attribute of anything but self and cls, where the name is defined in another module (`defined`:
    name -> the files that define it)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level:
            found += [f"{alias.name} (line {node.lineno})" for alias in node.names if _private(alias.name)]
        elif (
            isinstance(node, ast.Attribute)
            and _private(node.attr)
            and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
            and defined.get(node.attr)
            and str(path) not in defined[node.attr]
        ):
            found.append(f"{node.attr} (line {node.lineno})")
    return found


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _defined(paths: list[pathlib.Path]) -> dict[str, set[str]]:
    """Underscore name -> the files that define it: a function, a class, a name assigned in a module's or a class's
    body, an attribute stored on `self` or `cls`. A store on any other object (`mixer._live = True`) defines nothing:
    it writes another object's private field, and counts as a use (`_private_uses`)."""
    defined: dict[str, set[str]] = {}
    for path in paths:
        tree = ast.parse(path.read_text(), str(path))
        bodies = [tree.body, *(node.body for node in ast.walk(tree) if isinstance(node, ast.ClassDef))]
        for node in [*ast.walk(tree), *(statement for body in bodies for statement in body)]:
            names = []
            if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)):
                names = [node.name]
            elif (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name)
                and node.value.id in ("self", "cls")
            ):
                names = [node.attr]
            elif isinstance(node, (ast.Assign, ast.AnnAssign)) and any(node in body for body in bodies):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names = [name.id for target in targets for name in ast.walk(target) if isinstance(name, ast.Name)]
            for name in names:
                if _private(name):
                    defined.setdefault(name, set()).add(str(path))
    return defined


def test_no_module_uses_another_modules_private_names():
    """A module of the package reads no single-underscore name of another: what a sibling needs is public in its
    module (the package's public namespace is `recurrent_hooks/__init__.py`; the modules below are its
    implementation). No exception: what the engine and the studies ask of a kind is its adapter's public protocol
    (`kind.adapter`, engine/handle/adapter.py), which stays off the handle a researcher holds but for that one name."""
    sources = sorted(PACKAGE.rglob("*.py"))
    defined = _defined(sources)
    wrong = {str(path.relative_to(PACKAGE)): uses for path in sources if (uses := _private_uses(path, defined))}
    assert not wrong, f"underscore names of other modules used (make them public in their module): {wrong}"


def test_the_private_use_check_sees_one(tmp_path):
    (tmp_path / "a.py").write_text(
        "def _helper():\n    pass\n\nclass A:\n    def __init__(self):\n        self._live = False\n"
    )
    (tmp_path / "b.py").write_text(
        "from . import a\n\ndef f(x):\n    x._live = True\n    return a._helper(), x._elsewhere\n"
    )
    defined = _defined([tmp_path / "a.py", tmp_path / "b.py"])
    assert defined["_live"] == {str(tmp_path / "a.py")}, "a store on another object defined the name"
    assert sorted(_private_uses(tmp_path / "b.py", defined)) == ["_helper (line 5)", "_live (line 4)"]


# A unit's size is its statements, not its lines: the formatter (ruff format) spreads one call over as many lines as
# its arguments need, which says nothing of how much a unit does. The limits sit where the units that hold one role
# end today, with room: a unit that outgrows them is split by its roles, not waived.
MAX_CLASS_STATEMENTS = 240
MAX_FUNCTION_STATEMENTS = 70
SOURCES = sorted(PACKAGE.rglob("*.py"))


def _statements(node: ast.AST) -> int:
    """The statements inside a class or function (nested ones included, its own `def`/`class` not)."""
    return sum(isinstance(inner, ast.stmt) for inner in ast.walk(node)) - 1


def _too_long(path: pathlib.Path, root: pathlib.Path = PACKAGE.parent) -> list[str]:
    """The classes over MAX_CLASS_STATEMENTS statements and the functions over MAX_FUNCTION_STATEMENTS in one file
    (a docstring is one statement; decorators and comments are none)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ClassDef):
            limit, what = MAX_CLASS_STATEMENTS, "class"
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            limit, what = MAX_FUNCTION_STATEMENTS, "function"
        else:
            continue
        if (count := _statements(node)) > limit:
            found.append(
                f"{path.relative_to(root)}:{node.lineno} {what} {node.name}: {count} statements (limit {limit})"
            )
    return found


def test_no_class_over_240_statements_and_no_function_over_70():
    """A class holds one role and a function one step; long ones are split, not waived."""
    assert SOURCES, "no sources found under recurrent_hooks/"
    offenders = [line for path in SOURCES for line in _too_long(path)]
    assert not offenders, "too long:\n" + "\n".join(offenders)


def test_the_length_check_sees_a_long_function(tmp_path):
    """The reader counts a long function and a long class (so the test above can fail), in statements: one call
    spread over many lines is one."""
    source = tmp_path / "long.py"
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_STATEMENTS + 1))
    source.write_text(
        f"class C:\n    def f(self):\n{'    ' + body.replace(chr(10), chr(10) + '    ')}\n"
        + "".join(f"    y{i} = {i}\n" for i in range(MAX_CLASS_STATEMENTS - MAX_FUNCTION_STATEMENTS))
        + "\ndef g():\n    return max(\n"
        + "".join(f"        {i},\n" for i in range(200))
        + "    )\n"
    )
    found = [line.split()[1:3] for line in _too_long(source, tmp_path)]
    assert ["class", "C:"] in found and ["function", "f:"] in found and ["function", "g:"] not in found, found


def test_only_the_tracing_module_asks_whether_torch_compile_traces():
    """Compile awareness has one switch: `engine/tracing.py` asks torch (`compiling()`), everything else asks it."""
    asking = sorted(str(path.relative_to(PACKAGE)) for path in SOURCES if "is_compiling" in path.read_text())
    assert asking == ["engine/tracing.py"], f"modules that ask torch.compiler.is_compiling themselves: {asking}"


def test_the_per_call_tracker_branches_on_compiling_in_one_place():
    """The handle does not branch on torch.compile: its per-call tracker picks the traced implementation once
    (`CallTracker.now`), and compile support (`compiled.TracedCallTracker`) implements the same interface."""
    found = {}
    for name in ("handle/mixer.py", "tracking/tracker.py", "handle/kind.py", "handle/adapter.py"):
        tree = ast.parse((PACKAGE / "engine" / name).read_text())
        found[name] = sorted(
            f"{fn.name}"
            for fn in ast.walk(tree)
            if isinstance(fn, ast.FunctionDef)
            for node in ast.walk(fn)
            if isinstance(node, ast.Attribute)
            and node.attr in ("is_compiling", "compiling")
            or isinstance(node, ast.Name)
            and node.id in ("is_compiling", "compiling")
        )
    assert found == {
        "handle/mixer.py": [],
        "tracking/tracker.py": ["now"],
        "handle/kind.py": [],
        "handle/adapter.py": [],
    }, found


def test_every_path_is_one_runner_and_dispatch_branches_on_none():
    """Paths as a table (docs/architecture.md): each `Strategy` has its runner in `engine/paths/runners.py`, and the
    busy call looks it up; dispatch names no path but the token loop it falls back to."""
    from recurrent_hooks.engine import policy
    from recurrent_hooks.engine.paths import runners

    assert set(runners.RUNNERS) == set(policy.Strategy), sorted(map(str, runners.RUNNERS))
    tree = ast.parse((PACKAGE / "engine" / "dispatch" / "tap.py").read_text())
    named = sorted(
        {
            node.attr
            for node in ast.walk(tree)
            if isinstance(node, ast.Attribute)
            and "Strategy" in (getattr(node.value, "attr", None), getattr(node.value, "id", None))
        }
    )
    assert named == ["LOOP"], f"engine/dispatch/tap.py branches on the paths {named}: give the path a runner"


# the handle (`mixer`) and the modules it is built on import one way: the handle's tracker, its hooks, its kind's
# declaration and adapter and the compiled ops never import the handle, and the declaration imports no tracker
BELOW_THE_HANDLE = {
    "tracking/tracker": {"mixer", "compiled"},
    "tracking/hooks": {"mixer", "tracker", "compiled"},
    "handle/kind": {"mixer", "tracker", "compiled", "hooks"},
    "handle/adapter": {"mixer", "tracker", "compiled", "hooks"},
    "tracking/compiled": {"mixer"},
    "tracking/records": {"mixer", "tracker", "kind", "adapter", "compiled", "hooks"},
    "policy": {"mixer", "tracker"},
}


@pytest.mark.parametrize("module", sorted(BELOW_THE_HANDLE))
def test_the_handle_is_above_what_it_is_built_on(module):
    """One-way handle: a watch hands the handle's tracker what it asks (`policy.Request`) when the handle is made,
    and the tracker holds the kind and where the mixer is, never the handle (type-checking imports count too)."""
    found = {name.split(".")[-1] for name in _imports(PACKAGE / "engine" / f"{module}.py")}
    wrong = sorted(found & BELOW_THE_HANDLE[module])
    assert not wrong, f"recurrent_hooks/engine/{module}.py imports {wrong}"


# The engine's rooms, by stage of one forward, in the order they may import: a room imports only itself and the rooms
# before it (a type-checking import aside). docs/architecture.md draws them.
ROOMS = (
    "errors",
    "tracing",
    "policy",  # what everything reads: errors, the compile switch, the public policy
    "declare",  # what a kind is written in
    "tracking",  # the per-call bookkeeping
    "paths",  # how a busy call runs
    "handle",  # the user's handle on a mixer
    "binding",  # rebinding kernel names; the registry of families
    "dispatch",  # which forward a kernel call belongs to, and what runs it
    "attaching",
    "watch",
    "standalone",
    "support",
)  # the entry points, and what they share
ENGINE_FILES = sorted((PACKAGE / "engine").rglob("*.py"))


def _room(module: str) -> str:
    """The room of an engine module ("engine.paths.choose" -> "paths"; "engine.watch" -> "watch")."""
    return module.split(".")[1]


@pytest.mark.parametrize("path", ENGINE_FILES, ids=lambda p: str(p.relative_to(PACKAGE / "engine")))
def test_the_engines_rooms_import_one_way(path):
    here = path.relative_to(PACKAGE / "engine").with_suffix("").parts[0]
    if here == "__init__":
        return  # (the engine's docstring)
    assert here in ROOMS, f"recurrent_hooks/engine/{here} is in no room of ROOMS: say where it stands"
    later = sorted(
        m
        for m in _imports(path, runtime=True)
        if m.startswith("engine.")
        and len(m.split(".")) > 1
        and _room(m) in ROOMS
        and ROOMS.index(_room(m)) > ROOMS.index(here)
    )
    assert not later, (
        f"recurrent_hooks/engine/{path.relative_to(PACKAGE / 'engine')} ({here}) imports {later},"
        " from rooms after its own (tests/package/test_layout.py ROOMS)"
    )


def test_the_room_rule_sees_an_import_that_runs_up_and_passes_a_type_checking_one():
    source = ast.parse(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..handle.mixer import M\n"
        "from ..dispatch.tap import T\n"
    )
    here = ("engine", "paths")
    assert _imports_of(source, here) == {"engine.handle.mixer", "engine.dispatch.tap"}
    assert _imports_of(source, here, runtime=True) == {"engine.dispatch.tap"}
