"""The command line: `python -m recurrent_hooks demo | support [FAMILY | PATH] [--json]`.

- `demo`: read, patch and steer the states of a tiny model built from a config (no download).
- `support`: a line with the installed transformers version and whether it is in the tested range (on stderr
  with `--json`), then, per mixer class of every supported family, its kind and three sections: what works, what
  works with a caveat (the caveat said) and what is refused (what raises, and the error), then the recurrent mixers
  the library does not handle, and a legend of the words; with a family name, that family's rows; with the path of
  a saved model directory or its config.json, the same per mixer of that model, read from the config without
  loading weights (the model is built on the meta device). `--json` prints one object: `versions` (this library,
  transformers, torch, the tested transformers range and whether the installed one is in it), `legend` and `rows`.
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
    support = commands.add_parser(
        "support", help="what works, with a caveat or not, and what is refused, per family or per model"
    )
    support.add_argument("target", nargs="?", help="a family name, or a saved model directory / config.json")
    support.add_argument("--json", action="store_true", help="print JSON, for scripts")
    args = parser.parse_args(argv)
    transformers.logging.set_verbosity_error()  # the "falling back to its reference PyTorch implementation" notices
    if args.command == "demo":
        from .demo import main as demo

        demo()
        return 0
    try:
        entries = _support_entries(args.target)
    except (OSError, ValueError, LookupError) as error:
        print(f"python -m recurrent_hooks support: {error}", file=sys.stderr)
        return 2
    from .engine.binding.upstream import version_line
    from .engine.support import LEGEND, versions

    print(version_line(), file=sys.stderr if args.json else sys.stdout)  # --json: stdout is the JSON alone
    if args.json:
        print(
            json.dumps({"versions": versions(), "legend": LEGEND, "rows": [_json_row(*e) for e in entries]}, indent=2)
        )
    else:
        print(_table(entries))
    return 0


# an entry: the row's identity (family, mixer class, kind, ... as --json gives them), its head line, what works, and
# its limits (what -> a Caveat or a Refused)
Entry = tuple[dict[str, Any], str, tuple[str, ...], dict[str, str]]


def _support_entries(target: str | None) -> list[Entry]:
    from .engine.declare.limits import Refused
    from .engine.errors import Unavailable
    from .registry import FAMILIES, UNSUPPORTED

    if target is None or target in FAMILIES or target in {row.family for row in UNSUPPORTED}:
        entries = [_family_entry(mixer) for family in FAMILIES.values() for mixer in family.classes]
        entries += [
            (
                {"family": row.family, "mixer_class": row.mixer_class, "kind": None},
                f"{row.family}: {row.mixer_class} -> not supported",
                (),
                {"everything": Refused(Unavailable, row.reason)},
            )
            for row in UNSUPPORTED
        ]
        return entries if target is None else [e for e in entries if e[0]["family"] == target]
    path = pathlib.Path(target)
    if not path.exists():
        raise LookupError(
            f"{target!r} is neither a family ({', '.join(FAMILIES)}) nor a path to a saved model or config.json"
        )
    return [
        (
            {
                "path": row.path,
                "layer": row.layer,
                "mixer_class": row.mixer_class,
                "family": row.family,
                "kind": row.kind,
            },
            row.head,
            row.available,
            row.unavailable,
        )
        for row in _model_support(path)
    ]


def _family_entry(mixer: Any) -> Entry:
    """One mixer class of a family (a `MixerClass`): its kind, what works and its limits."""
    from .engine.support import available_of, limits_of

    kind = mixer.kind
    return (
        {"family": mixer.name, "mixer_class": mixer.mixer_class, "kind": kind.__name__, "state": kind.STATE},
        f"{mixer.name}: {mixer.mixer_class} -> {kind.__name__}",
        available_of(kind),
        limits_of(mixer),
    )


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


def _json_row(row: dict[str, Any], head: str, works: tuple[str, ...], limits: dict[str, str]) -> dict[str, Any]:
    from .engine.declare.limits import error_names
    from .engine.support import caveats_of, refused_of

    return {
        **row,
        "works": list(works),
        "caveats": {what: str(why) for what, why in caveats_of(limits).items()},
        "refused": {
            what: {"raises": list(error_names(why)), "why": str(why)} for what, why in refused_of(limits).items()
        },
    }


def _table(entries: list[Entry]) -> str:
    from .engine.support import describe, legend

    if not entries:
        return "no recurrent mixer"
    return "\n".join(describe(head, works, limits) for _, head, works, limits in entries) + "\n\n" + legend()


if __name__ == "__main__":
    raise SystemExit(main())
