"""`support` says, per family and per mixer, what works, what works with a caveat and what is refused (with the
errors), read from the kinds' and families' declarations: every limit is a `Caveat` or a `Refused`, sorted by type
and never by words; each family's row is about that family only; a fact of one transformers release is listed under
that release only; the refusals checked here raise what they declare; the command prints the legend, and its
`--json` names this library's, transformers' and torch's releases and the tested range."""

import copy
import importlib.metadata
import json
import pickle
import re

import pytest
import torch
import transformers
from _compare import assert_close
from _models import build, random_ids

import recurrent_hooks as rh
import recurrent_hooks.registry as rh_registry
from recurrent_hooks.__main__ import main
from recurrent_hooks.engine.binding import upstream
from recurrent_hooks.engine.declare.limits import Caveat, Refused, error_names, is_refused
from recurrent_hooks.engine.support import LEGEND, available_of, limits_of
from recurrent_hooks.kinds.shared.recording import RECORDING

MIXERS = [mixer for family in rh.FAMILIES.values() for mixer in family.classes]  # every (family, mixer class)


def _limits(family: str) -> dict[str, str]:
    return limits_of(rh.FAMILIES[family].classes[0])


# -- the declarations -------------------------------------------------------------------------------------------------


def test_every_limit_of_the_library_is_a_caveat_or_a_refusal_with_its_errors():
    for mixer in MIXERS:
        for what, why in limits_of(mixer).items():
            assert type(why) in (Caveat, Refused), (
                f"{mixer.name} ({mixer.kind.__name__}): {what!r} is a {type(why).__name__}: a Caveat or a Refused?"
            )
            assert what.strip() and why.strip()
            if is_refused(why):
                assert why.errors and all(issubclass(error, BaseException) for error in why.errors)


def test_each_family_row_is_about_its_own_family():
    """A limit that names another family belongs to that family's row (inkling's several mixers per layer were once
    listed under every short convolution, lfm2's included)."""
    for mixer in MIXERS:
        text = " ".join(f"{what} {why}" for what, why in limits_of(mixer).items())
        others = sorted(
            name for name in set(rh.FAMILIES) - {mixer.name} if re.search(rf"(?<![\w.]){re.escape(name)}(?!\w)", text)
        )
        assert not others, f"{mixer.name}'s limits name {others}: put those facts in their own families' rows"
    assert "one memory per layer" in _limits("inkling") and "one memory per layer" not in _limits("lfm2")


def test_a_fact_of_one_transformers_release_is_listed_under_that_release_only():
    """A limit naming a release is read from the installed one (`upstream.is_at_least`); what holds for every tested
    release names none (minimax's and recurrent_gemma's beam search hold for 5.24 and 5.25 alike)."""
    installed = re.match(r"\d+\.\d+", upstream.installed_version())[0]
    for mixer in MIXERS:
        for what, why in limits_of(mixer).items():
            named = set(re.findall(r"(?<![\w.])5\.\d+(?![\d])", f"{what} {why}"))
            assert named <= {installed}, f"{mixer.name}: {what!r} names transformers {named} under {installed}"


@pytest.mark.parametrize(
    "family, what",
    [
        ("mamba2", "dt_limit at decode steps"),
        ("mamba", "multi-token continuation"),
        ("recurrent_gemma", "multi-token continuation"),
        ("recurrent_gemma", "one-token prompt"),
        ("recurrent_gemma", "memory outside the Cache"),
        ("recurrent_gemma", "beam search"),
        ("minimax", "beam search"),
        ("kimi_linear", "packed sequences"),
        ("rwkv", "batched decode"),
    ],
)
def test_what_runs_is_a_caveat_not_a_refusal(family, what):
    assert type(_limits(family)[what]) is Caveat


@pytest.mark.parametrize(
    "family, what, errors",
    [
        ("qwen3_5", "packed sequences", (ValueError, rh.RecurrentHooksError)),
        ("recurrent_gemma", "conv window channels", (RuntimeError,)),
        ("rwkv", "gradients with a state", (RuntimeError,)),
        ("xlstm", "beam search", (ValueError,)),
        ("minimax", "windows", (rh.Unavailable,)),
        ("lfm2", "state", (rh.Unavailable,)),
    ],
)
def test_what_raises_is_a_refusal_with_its_errors(family, what, errors):
    limit = _limits(family)[what]
    assert type(limit) is Refused and limit.errors == errors


def test_limits_are_strs_that_repr_copy_and_pickle_as_themselves():
    refused = Refused((ValueError, rh.RecurrentHooksError), "packed batches need a package")
    assert refused == "packed batches need a package" and isinstance(refused, str)
    assert repr(refused) == "Refused(ValueError | rh.RecurrentHooksError, 'packed batches need a package')"
    assert error_names(refused) == ("ValueError", "rh.RecurrentHooksError") and error_names(Caveat("x")) == ()
    for again in (pickle.loads(pickle.dumps(refused)), copy.deepcopy(refused)):
        assert type(again) is Refused and again == refused and again.errors == refused.errors
    caveat = Caveat("it runs")
    assert repr(caveat) == "Caveat('it runs')" and type(pickle.loads(pickle.dumps(caveat))) is Caveat
    assert Refused(RuntimeError, "x").errors == (RuntimeError,)
    with pytest.raises(
        rh.InvalidValue,
        match=r"Refused: expected the exception class it raises, or a tuple of them,"
        r" got 'ValueError'",
    ):
        Refused("ValueError", "why")
    with pytest.raises(rh.InvalidValue, match="Refused: expected the reason as a non-empty str, got ''"):
        Refused(ValueError, "")


def test_a_plain_str_limit_is_listed_as_a_caveat(monkeypatch):
    """A kind written before the types declares plain strs: they are listed, as caveats."""
    monkeypatch.setattr(rh.Mamba2StateSpace, "LIMITS", {"an old limit": "in plain words"})
    (row, *_) = rh.support(build("mamba2"))
    assert row.caveats == {"an old limit": "in plain words"} and row.refused == {}


# -- support(model) ---------------------------------------------------------------------------------------------------


def test_a_models_rows_split_every_limit_into_caveats_and_refusals():
    (row, *_) = rh.support(build("recurrent_gemma"))
    assert row.works == row.available == available_of(rh.RealGatedLinearRecurrence)
    assert {**row.caveats, **row.refused} == row.unavailable and not set(row.caveats) & set(row.refused)
    assert all(type(why) is Caveat for why in row.caveats.values())
    assert row.refused["effective attention"].errors == (rh.Unavailable,)
    text = str(row)
    assert text.startswith(
        f"{row.head}\n  works: states, windows, inputs, outputs, values, writes, hooks\n"
        "  works with a caveat:\n    multi-token continuation: "
    )
    assert "\n  refused:\n    conv window channels (raises RuntimeError): " in text
    assert "\n    effective attention (raises rh.Unavailable): " in text and "\n  how calls run:\n" in text
    assert (
        row.head == "model.layers.0.temporal_block (RecurrentGemmaRecurrentBlock, layer 0, recurrent_gemma ->"
        " RealGatedLinearRecurrence)"
    )


@pytest.mark.skipif(not upstream.is_at_least(5, 25), reason="transformers 5.24 keeps no intermediate recurrent states")
@pytest.mark.parametrize("family", ["qwen3_5", "kimi_linear", "mamba", "mamba2", "zamba", "lfm2"])
def test_a_recording_cache_runs_hooked_as_support_says(family):
    """transformers 5.25 splits a forward over a cache that records its past into a prompt-kernel call and one-token
    decode-kernel calls in four kinds; `support` lists a caveat for those (`SPLIT_RECORDING`): a hooked call gives the
    model's logits where it lists nothing or a caveat, and raises what a refusal declares."""
    model, ids = build(family), random_ids(1, 5)
    limit = _limits(family).get(RECORDING)

    def continue_recording():
        with torch.no_grad():
            cache = model(ids, use_cache=True).past_key_values
            cache.activate_past_recording(recurrent_states_to_keep=2)
            return model(torch.tensor([[7, 8, 9]], device=ids.device), cache=cache, use_cache=True).logits

    plain = continue_recording()
    with rh.watch(model) as w:
        w.mixers[0].register_state_hook(lambda m, c, t, s: None, memory=type(w.mixers[0]).MEMORIES[0])
        if not isinstance(limit, Refused):  # nothing listed, or a caveat: it runs
            assert_close("a hooked recording forward", plain, continue_recording(), rtol=1e-5, atol=1e-6)
        else:
            with pytest.raises(limit.errors):
                continue_recording()


# -- the command ------------------------------------------------------------------------------------------------------


def test_the_command_prints_three_sections_per_row_and_the_legend(capsys):
    assert main(["support", "recurrent_gemma"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(
        f"{upstream.version_line()}\nrecurrent_gemma: RecurrentGemmaRecurrentBlock ->"
        " RealGatedLinearRecurrence\n  works: states, windows, inputs, outputs, values, writes,"
        " hooks\n  works with a caveat:\n"
    )
    assert "\n  refused:\n    conv window channels (raises RuntimeError): " in out
    rows, legend = out.split("\nlegend:\n")
    assert "  available:" not in rows and "  unavailable:" not in rows  # the former sections
    for term in LEGEND:
        assert re.search(rf"^ +{re.escape(term)}: ", legend, flags=re.M), f"the legend has no {term!r}"


def test_every_word_of_works_is_in_the_legend():
    words = {word for mixer in MIXERS for word in available_of(mixer.kind)}
    terms = {word for term in LEGEND for word in term.split(", ")}
    assert words <= terms, f"the legend does not say what {sorted(words - terms)} mean"


def _json_row(limits: dict[str, str]) -> dict:
    return {
        "caveats": {what: str(why) for what, why in limits.items() if not is_refused(why)},
        "refused": {
            what: {"raises": list(error_names(why)), "why": str(why)} for what, why in limits.items() if is_refused(why)
        },
    }


def test_the_json_names_the_releases_and_gives_each_row_its_three_sections(capsys, request):
    row = rh_registry.Unsupported("llama", "LlamaAttention", "a stand-in reason")
    rh_registry.register(row)
    request.addfinalizer(lambda: rh_registry.unregister(row))
    assert main(["support", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["versions"] == {
        "recurrent_hooks": importlib.metadata.version("recurrent_hooks"),
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "tested_range": upstream.TESTED_RANGE,
        "transformers_tested": upstream.is_tested(),
    }
    assert printed["legend"] == LEGEND
    rows = printed["rows"]
    assert [(r["family"], r["mixer_class"]) for r in rows if r["kind"]] == [(m.name, m.mixer_class) for m in MIXERS]
    for mixer, got in zip(MIXERS, rows):
        assert got == {
            "family": mixer.name,
            "mixer_class": mixer.mixer_class,
            "kind": mixer.kind.__name__,
            "state": mixer.kind.STATE,
            "works": list(available_of(mixer.kind)),
            **_json_row(limits_of(mixer)),
        }
    assert rows[-1] == {
        "family": "llama",
        "mixer_class": "LlamaAttention",
        "kind": None,
        "works": [],
        "caveats": {},
        "refused": {"everything": {"raises": ["rh.Unavailable"], "why": "a stand-in reason"}},
    }


def test_the_json_of_a_saved_model_has_its_mixers_three_sections(tmp_path, capsys):
    build("lfm2_moe").save_pretrained(tmp_path)
    assert main(["support", str(tmp_path), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    limits = _limits("lfm2_moe")
    assert rows == [
        {
            "path": f"model.layers.{layer}.conv",
            "layer": layer,
            "mixer_class": "Lfm2MoeShortConv",
            "family": "lfm2_moe",
            "kind": "ShortConvolution",
            "works": list(available_of(rh.ShortConvolution)),
            **_json_row(limits),
        }
        for layer in (0, 2)
    ]
