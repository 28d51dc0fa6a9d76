"""The command line: `python -m recurrent_hooks demo | support [FAMILY | PATH] [--json]`.

- `demo`: read, patch and steer the states of a tiny model built from a config (no download).
- `support`: a line with the installed transformers version and whether it is in the tested range (on stderr
  with `--json`), then the table of supported families (kind, what can be read and written, limits) and of the
  recurrent mixers the library does not handle; with a family name, that family's row; with the path of
  a saved model directory or its config.json, what each mixer of that model offers, read from the config
  without loading weights (the model is built on the meta device).
"""

import argparse
import json
import pathlib
import sys
from typing import Any

import transformers


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m recurrent_hooks", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("demo", help="read, patch and steer a tiny model's states")
    support = commands.add_parser("support", help="what can be read and written, per family or per model")
    support.add_argument("target", nargs="?", help="a family name, or a saved model directory / config.json")
    support.add_argument("--json", action="store_true", help="print JSON, for scripts")
    args = parser.parse_args(argv)
    transformers.logging.set_verbosity_error()  # the "falling back to its reference PyTorch implementation" notices
    if args.command == "demo":
        from .demo import main as demo

        demo()
        return 0
    try:
        rows = _support_rows(args.target)
    except (OSError, ValueError, LookupError) as error:
        print(f"python -m recurrent_hooks support: {error}", file=sys.stderr)
        return 2
    from .engine.binding.upstream import version_line

    print(version_line(), file=sys.stderr if args.json else sys.stdout)  # --json: stdout is the rows alone
    print(json.dumps(rows, indent=2) if args.json else _table(rows))
    return 0


def _support_rows(target: str | None) -> list[dict[str, Any]]:
    from .registry import FAMILIES, UNSUPPORTED

    if target is None or target in FAMILIES or target in {row.family for row in UNSUPPORTED}:
        rows = [_family_row(mixer) for family in FAMILIES.values() for mixer in family.classes]
        rows += [{"family": row.family, "mixer_class": row.mixer_class, "kind": None, "available": [],
                  "unavailable": {"everything": row.reason}} for row in UNSUPPORTED]
        return rows if target is None else [row for row in rows if row["family"] == target]
    path = pathlib.Path(target)
    if not path.exists():
        raise LookupError(f"{target!r} is neither a family ({', '.join(FAMILIES)}) nor a path to a saved model"
                          " or config.json")
    return [_mixer_row(row) for row in _model_support(path)]


def _family_row(mixer: Any) -> dict[str, Any]:
    """One mixer class of a family (a `MixerClass`): its kind, what it offers and its limits."""
    from .engine.support import available_of

    kind = mixer.kind
    return {"family": mixer.name, "mixer_class": mixer.mixer_class, "kind": kind.__name__,
            "state": kind.STATE, "available": list(available_of(kind)),
            "unavailable": {**kind.LIMITS, **mixer.family.limits}}


def _model_support(path: pathlib.Path) -> list[Any]:
    import torch

    from .engine.support import support

    config = transformers.AutoConfig.from_pretrained(str(path.parent if path.is_file() else path))
    with torch.device("meta"):
        try:
            model = transformers.AutoModelForCausalLM.from_config(config)
        except ValueError:  # not a causal LM: the base model has the same mixers
            model = transformers.AutoModel.from_config(config)
    return support(model)


def _mixer_row(row: Any) -> dict[str, Any]:
    return {"path": row.path, "layer": row.layer, "mixer_class": row.mixer_class, "family": row.family,
            "kind": row.kind, "available": list(row.available), "unavailable": dict(row.unavailable)}


def _table(rows: list[dict[str, Any]]) -> str:
    lines = []
    for row in rows:
        where = f"{row['path']} (layer {row['layer']}): " if "path" in row else f"{row['family']}: "
        kind = row["kind"] or "not supported"
        lines.append(f"{where}{row['mixer_class']} -> {kind}")
        if row["available"]:
            lines.append(f"  available: {', '.join(row['available'])}")
        lines += [f"  unavailable: {what}: {why}" for what, why in row["unavailable"].items()]
    return "\n".join(lines) if lines else "no recurrent mixer"


if __name__ == "__main__":
    raise SystemExit(main())
