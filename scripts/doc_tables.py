"""Write the family tables of README.md, docs/api.md and docs/concepts.md from the registry, and the legend of
`support` in docs/api.md from the code's.

    python scripts/doc_tables.py           # rewrite the tables where the registry has changed
    python scripts/doc_tables.py --check   # exit 1, naming the pages, where a table is not the registry

A family is one registry row (`recurrent_hooks.registry`): adding it changes no page by hand. What is generated:
- docs/api.md's table `| family | mixer class | kind |`: every (family, mixer class) of the registry, in its order;
- the families cell of each row of README.md's and docs/concepts.md's kind tables. A row names its kind first, in
  backticks, and may name the kinds it covers beside it (README: "(`SelectiveScan`, `PerHeadSelectiveScan`)";
  concepts.md: "`ShortConvolution` (...; `LoopedShortConvolution`: ...)"): its families are those of the first
  kind, or of every kind named in its first cell where the row lists those today (how the row reads is kept);
- a kind of the registry without a row gets one, from its declaration: its name, the first line of its docstring
  and (concepts.md) its `STATE` axes, for its author to finish in words;
- docs/api.md's table `| in support's output | means |`: `recurrent_hooks.engine.support.LEGEND`, which
  `python -m recurrent_hooks support` prints under its table.
tests/package/test_docs.py runs the check.
"""

import argparse
import pathlib
import re
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import recurrent_hooks as rh  # noqa: E402
from recurrent_hooks.engine.support import LEGEND  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
API_HEADER = "| family | mixer class | kind |"
KIND_TABLES = {"README.md": "| mixer kind | families |", "docs/concepts.md": "| kind | families | state | axes |"}
LEGEND_HEADER = "| in support's output | means |"


def registry_rows() -> list:
    """Every (family, mixer class) of the registry, in its order."""
    return [mixer for row in rh.FAMILIES.values() for mixer in row.classes]


def families_by_kind() -> dict[str, list[str]]:
    by_kind: dict[str, list[str]] = {}
    for mixer in registry_rows():
        names = by_kind.setdefault(mixer.kind.__name__, [])
        if mixer.name not in names:
            names.append(mixer.name)
    return by_kind


def _table(lines: list[str], header: str) -> tuple[int, int]:
    """The first and one-past-last line of the table under `header` (its header and separator included)."""
    start = next(i for i, line in enumerate(lines) if line.strip() == header)
    end = start
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    return start, end


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def api_table(text: str) -> str:
    lines = text.splitlines()
    start, end = _table(lines, API_HEADER)
    rows = [f"| {m.name} | `{m.mixer_class}` | `{m.kind.__name__}` |" for m in registry_rows()]
    return "\n".join(lines[: start + 2] + rows + lines[end:]) + "\n"


def legend_table(text: str) -> str:
    """The page with the legend table written from `LEGEND`."""
    lines = text.splitlines()
    start, end = _table(lines, LEGEND_HEADER)
    rows = [f"| `{term}` | {meaning.replace('|', chr(92) + '|')} |" for term, meaning in LEGEND.items()]
    return "\n".join(lines[: start + 2] + rows + lines[end:]) + "\n"


def _first_line(kind: type) -> str:
    doc = (kind.__doc__ or kind.__name__).strip().splitlines()[0].rstrip(".")
    return doc if doc[1:2].isupper() else doc[0].lower() + doc[1:]  # "RWKV-4 ..." stays


def _new_row(page: str, kind: type, families: list[str]) -> str:
    names = ", ".join(families)
    if page == "README.md":
        return f"| {_first_line(kind)} (`{kind.__name__}`) | {names} |"
    state = kind.STATE if isinstance(kind.STATE, str) else ", ".join(f"{k} `{v}`" for k, v in kind.STATE.items())
    return f"| `{kind.__name__}` ({_first_line(kind)}) | {names} | | `{state}` |"


def kind_table(text: str, page: str) -> str:
    """The page with each kind row's families cell from the registry, and a row for a kind without one."""
    by_kind, lines = families_by_kind(), text.splitlines()
    start, end = _table(lines, KIND_TABLES[page])
    covered, rows = set(), lines[start + 2 : end]
    for i, line in enumerate(rows):
        cells = _cells(line)
        named = [name for name in re.findall(r"`(\w+)`", cells[0]) if name in by_kind]
        if not named:
            continue
        listed = {name for name in re.split(r"[,\s]+", cells[1]) if name in rh.FAMILIES}
        first = by_kind[named[0]]
        union = list(dict.fromkeys(family for kind in named for family in by_kind[kind]))
        families = union if listed - set(first) else first  # the row covers the other kinds it names, or not
        covered.update(named if families is union else named[:1])
        cells[1] = ", ".join(families)
        rows[i] = "| " + " | ".join(cells) + " |"
    kinds = dict.fromkeys(mixer.kind for mixer in registry_rows())
    rows += [_new_row(page, kind, by_kind[kind.__name__]) for kind in kinds if kind.__name__ not in covered]
    return "\n".join(lines[: start + 2] + rows + lines[end:]) + "\n"


def generated() -> dict[str, str]:
    """Each page as the registry makes it."""
    pages = {"docs/api.md": legend_table(api_table((ROOT / "docs/api.md").read_text()))}
    for page in KIND_TABLES:
        pages[page] = kind_table((ROOT / page).read_text(), page)
    return pages


def stale() -> list[str]:
    """The pages whose tables are not the registry's."""
    return [page for page, text in generated().items() if (ROOT / page).read_text() != text]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 where a table is stale")
    args = parser.parse_args()
    if args.check:
        pages = stale()
        for page in pages:
            print(f"{page}: its family tables are not the registry's: run python scripts/doc_tables.py")
        return 1 if pages else 0
    for page, text in generated().items():
        if (ROOT / page).read_text() != text:
            (ROOT / page).write_text(text)
            print(f"wrote {page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
