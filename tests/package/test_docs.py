"""The README, the docs, the examples and the demo run as written, and name every supported family."""

import importlib.util
import pathlib
import re
import runpy
import subprocess
import sys
import types

import pytest

import recurrent_hooks as rh
import recurrent_hooks.engine.binding.rebinding as patching
from recurrent_hooks.engine.declare.kernels import Site

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))


def python_blocks(path: pathlib.Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


# harvest.md's blocks write and read a dataset's shards (9 s; tests/studies/test_harvest.py covers them): with --full
@pytest.mark.parametrize(
    "path",
    [pytest.param(path, marks=pytest.mark.full) if path.name == "harvest.md" else path for path in DOCS],
    ids=lambda p: p.name,
)
def test_code_blocks_run(path):
    """A page's python blocks run in order, in one namespace, as a reader would paste them."""
    blocks = python_blocks(path)
    assert blocks or path.name != "README.md", "the README has no example"
    namespace: dict = {"__name__": f"docs.{path.stem}"}
    for number, block in enumerate(blocks):
        try:
            exec(compile(block, f"{path.name}, python block {number + 1}", "exec"), namespace)
        finally:
            for name in ("w", "h"):  # a failing block must not leave a watch or hook active
                if hasattr(namespace.get(name), "remove"):
                    namespace[name].remove()
    # nothing stays rebound: not by a watch or hook, not by a route_kernels("...", "torch") left in place
    for family in (mixer for row in rh.FAMILIES.values() for mixer in row.classes):
        for kernel in family.kind.KERNELS:
            if kernel.site is Site.INSTANCE:
                continue  # bound per module of a model, released with its watch (tests/kinds/test_contract.py)
            target = family.target(kernel)
            assert patching.bound_original(*target) is patching.import_default(*target), (
                f"{path.name} left {kernel.name} rebound"
            )
            assert not patching._BINDINGS, f"{path.name} left a binding: {sorted(patching._BINDINGS)}"


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_run(path, capsys):
    runpy.run_path(str(path), run_name="__main__")
    assert capsys.readouterr().out.strip(), f"{path.name} printed nothing"


def test_the_demo_runs():
    result = subprocess.run(
        [sys.executable, "-m", "recurrent_hooks", "demo"], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    for step in ("1. ", "2. patch", "3. generate", "4. "):
        assert step in result.stdout, f"the demo's step {step!r} is missing:\n{result.stdout}"


@pytest.mark.parametrize("page", ["README.md", "docs/api.md", "docs/concepts.md"])
def test_pages_name_every_supported_family(page):
    text = (ROOT / page).read_text()
    missing = [name for name in rh.FAMILIES if name not in text]
    assert not missing, f"{page} does not mention {missing}"


def _table_rows(text: str) -> list[list[str]]:
    return [
        [cell.strip() for cell in line.strip().strip("|").split("|")]
        for line in text.splitlines()
        if line.startswith("|") and not line.startswith("| ---")
    ]


def test_the_family_tables_are_the_registry():
    """api.md's family table is the registry row for row; in the kind tables of README and concepts.md,
    each kind (the first name in backticks of a row, with a sibling it covers) lists exactly its families."""
    registry = [mixer for row in rh.FAMILIES.values() for mixer in row.classes]  # inkling2: mixers of two kinds
    rows = {
        (row[0].strip("`"), row[1].strip("`"), row[2].strip("`"))
        for row in _table_rows((ROOT / "docs/api.md").read_text())
        if row and row[0].strip("`") in rh.FAMILIES
    }
    assert rows == {(f.name, f.mixer_class, f.kind.__name__) for f in registry}
    by_kind: dict[str, set[str]] = {}
    for family in registry:
        by_kind.setdefault(family.kind.__name__, set()).add(family.name)
    checked = 0
    for page in ("README.md", "docs/concepts.md"):
        for row in _table_rows((ROOT / page).read_text()):
            first = re.findall(r"`(\w+)`", row[0])
            kinds = [name for name in first[:2] if name in by_kind]  # "Mamba-1 (`SelectiveScan`, `PerHead...`)"
            if not kinds or len(row) < 2:
                continue
            named = {name for name in re.split(r"[,\s]+", row[1]) if name in rh.FAMILIES}
            # a row names its kind first; it may name a sibling it covers too, or the parent it extends
            wants = [by_kind[kinds[0]], set().union(*(by_kind[kind] for kind in kinds))]
            assert named in wants, f"{page}: the row {row[0]!r} lists {sorted(named)}, the registry {sorted(wants[0])}"
            checked += 1
    assert checked >= len(by_kind), "the kind tables were not found"
    assert not (pages := TABLES.stale()), (
        f"{pages}: the family tables are not the registry's: run python scripts/doc_tables.py"
    )


def _script(name: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TABLES = _script("doc_tables")  # the generator of the family tables


def test_a_new_family_and_a_new_kind_reach_the_tables_without_a_hand_edit(monkeypatch):
    """scripts/doc_tables.py puts a new family in api.md's table and in its kind's rows, and gives a new kind a
    row of its own from its declaration."""

    class Hypothetical(rh.RecurrentMixer):
        """A recurrence of the tests' own."""

        STATE = "batch heads key_dim value_dim"

    row = types.SimpleNamespace
    rows = TABLES.registry_rows() + [
        row(name="my_qwen", mixer_class="MyQwenGatedDeltaNet", kind=rh.GatedDeltaNet),
        row(name="my_model", mixer_class="MyMixer", kind=Hypothetical),
    ]
    monkeypatch.setattr(TABLES, "registry_rows", lambda: rows)
    api, readme, concepts = (TABLES.generated()[page] for page in ("docs/api.md", "README.md", "docs/concepts.md"))
    assert "| my_qwen | `MyQwenGatedDeltaNet` | `GatedDeltaNet` |" in api
    assert "| my_model | `MyMixer` | `Hypothetical` |" in api
    assert re.search(r"\| gated DeltaNet \(`GatedDeltaNet`\) \| qwen3_next, .*lara_mini, my_qwen \|", readme)
    assert "| a recurrence of the tests' own (`Hypothetical`) | my_model |" in readme
    row = "| `Hypothetical` (a recurrence of the tests' own) | my_model | | `batch heads key_dim value_dim` |"
    assert row in concepts


def test_ci_runs_the_readme_test_command_in_a_fresh_environment():
    """`.ci/run` installs what the README's test command installs, in a virtual environment it makes itself (so a
    dependency missing from pyproject.toml fails CI), and runs pytest there."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Tests") :]
    command = re.search(r"```bash\n(.*?)\n```", section, flags=re.S).group(1)
    steps = [step.strip() for step in command.split("&&")]
    ci = (ROOT / ".ci" / "run").read_text()
    assert "python3 -m venv" in ci and "activate" in ci, ".ci/run does not make its own virtual environment"
    for step in steps:
        if step.startswith("pip install"):
            assert f"python -m {step.replace('pip install', 'pip install -q', 1)}" in ci, (
                f".ci/run does not run the README's {step!r}"
            )
    assert steps[-1].startswith("pytest") and "python -m pytest" in ci, f"the README's last step is {steps[-1]!r}"
