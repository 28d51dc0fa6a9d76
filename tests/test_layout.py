"""The package's layers import one way: the engine imports no kind, no study and not the registry; a kind imports
no study (docs/architecture.md). Read from the source, so an import inside a function counts too."""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "recurrent_hooks"


def _imports(path: pathlib.Path) -> set[str]:
    """The modules below recurrent_hooks that the file imports, as dotted paths ("engine.kernels", "registry")."""
    here = path.relative_to(PACKAGE).with_suffix("").parts[:-1]  # the file's package below recurrent_hooks
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
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
            found.update(".".join(alias.name.split(".")[1:]) for alias in node.names
                         if alias.name.split(".")[0] == "recurrent_hooks" and "." in alias.name)
    return found


def _layer(module: str) -> str:
    return module.split(".")[0]


FORBIDDEN = {"engine": {"kinds", "studies", "registry", "toys", "extend", "demo", "plots"},
             "kinds": {"studies", "registry", "toys", "extend", "demo", "plots"}}
FILES = sorted(p for layer in FORBIDDEN for p in (PACKAGE / layer).rglob("*.py"))


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_run_one_way(path):
    layer = path.relative_to(PACKAGE).parts[0]
    wrong = sorted(m for m in _imports(path) if _layer(m) in FORBIDDEN[layer])
    assert not wrong, f"recurrent_hooks/{path.relative_to(PACKAGE)} ({layer}) imports {wrong}"


def test_the_layers_are_there_and_the_check_sees_imports():
    """Each layer has modules, and the import reader finds a relative import across layers (so the test can fail)."""
    for layer in ("engine", "kinds", "studies"):
        assert len(list((PACKAGE / layer).glob("*.py"))) > 2, f"recurrent_hooks/{layer} has no modules"
    assert "engine.kernels" in _imports(PACKAGE / "kinds" / "gated_delta_net.py")
    assert "engine.mixer" in _imports(PACKAGE / "studies" / "effective_attention.py")
    assert {"kinds.gated_delta_net", "engine.families"} <= _imports(PACKAGE / "registry.py")
