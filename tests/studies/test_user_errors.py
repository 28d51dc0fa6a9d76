"""What a user's function raises, and what a study takes from a metric.

- An exception raised by a user's hook (in a watch, at a prompt token, at a decode step, in a compiled graph, or
  standalone), a reduction or a metric keeps its type and gains a note (PEP 678) saying where: the hook, the
  mixer and its layer, the call and the token; the reduction and the tokens; the study and the logits' shape.
- One metric contract for `rh.attribute` and `rh.patching_sweep` (docs/api.md, "Metrics"): the same forms taken,
  the same ones refused with the same message.
"""

import pytest
import torch
from _compare import assert_close
from _models import build, random_ids

import recurrent_hooks as rh

T = 6


def _bad_hook(mixer, call, token, state):
    return call.index  # the hook's `call` is an int


def _notes(error) -> list[str]:
    return getattr(error.value, "__notes__", [])


@pytest.fixture(scope="module")
def model():
    return build("qwen3_5")


def test_an_error_in_a_hook_at_a_prompt_token_says_where(model):
    with rh.watch(model) as w, torch.no_grad():
        w.mixers[1].register_state_hook(_bad_hook, token=4)
        with pytest.raises(AttributeError, match="'int' object has no attribute 'index'") as error:
            model(random_ids(1, T))
    assert _notes(error) == [
        "raised in the state hook _bad_hook on GatedDeltaNet(qwen3_5, layer 2), at call 0, token 4"
    ]


def test_an_error_in_a_hook_at_a_decode_step_says_where(model):
    with rh.watch(model) as w:
        w.mixers[0].register_state_hook(_bad_hook, call=2, memory="window")
        with pytest.raises(AttributeError) as error:
            model.generate(random_ids(1, T), max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert _notes(error) == [
        "raised in the window hook _bad_hook on GatedDeltaNet(qwen3_5, layer 0), at call 2, token 0"
    ]


def test_an_error_in_a_standalone_hook_says_where(model):
    mixer_module = model.model.layers[0].linear_attn
    handle = rh.register_state_hook(mixer_module, lambda m, c, t, s: 1 / 0 if t == 3 else None)
    try:
        with pytest.raises(ZeroDivisionError) as error, torch.no_grad():
            model(random_ids(1, T))
    finally:
        handle.remove()
    (note,) = _notes(error)
    assert note.startswith("raised in the state hook ") and note.endswith(
        " on GatedDeltaNet(qwen3_5, layer 0), at call 0, token 3"
    )


def test_an_error_in_a_hook_inside_a_compiled_graph_says_where():
    torch._dynamo.reset()
    model = build("mamba")
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    try:
        with rh.watch(model) as w, torch.no_grad():
            w.mixers[0].register_state_hook(lambda m, c, t, s: {}["missing"] if t == 2 else None)
            with pytest.raises(KeyError) as error:
                compiled(random_ids(1, T))
    finally:
        torch._dynamo.reset()
    assert any(note.endswith("on SelectiveScan(mamba, layer 0), at call 0, token 2") for note in _notes(error)), _notes(
        error
    )


def test_an_error_in_a_reduction_says_where(model):
    def bad(states):
        raise RuntimeError("my reduction")

    with pytest.raises(RuntimeError, match="my reduction") as error, torch.no_grad():
        with rh.watch(model, keep=("states",), reduce={"states": bad}):
            model(random_ids(1, T))
    (note,) = _notes(error)
    assert note.startswith("raised in GatedDeltaNet(qwen3_5, layer 0), call 0, tokens 0..5: the reduction"), note


# -- the metric contract ---------------------------------------------------------------------------------------------


def _sweep(model, clean, corrupt, metric):
    return rh.patching_sweep(model, clean, corrupt, metric, positions=[1, 3]).values


def _attribute(model, clean, corrupt, metric):
    return rh.attribute(model, clean, corrupt, metric).memory


STUDIES = {"patching_sweep": _sweep, "attribute": _attribute}


@pytest.mark.parametrize("study", STUDIES)
def test_both_studies_take_the_same_metric_forms(model, study):
    """One value per row; a 0-d tensor (a metric written for one prompt: one pair, or called once per row for
    several); rh.metrics' metrics: all give the same numbers."""
    run, frozen = STUDIES[study], build("qwen3_5").requires_grad_(False)
    clean, corrupt = random_ids(2, T, seed=1), random_ids(2, T, seed=2)
    per_row = run(frozen, clean, corrupt, lambda logits: logits[:, -1, 5] - logits[:, -1, 7])
    scalar = run(frozen, clean, corrupt, lambda logits: (logits[:, -1, 5] - logits[:, -1, 7]).sum())
    ours = run(frozen, clean, corrupt, rh.metrics.logit_difference(5, 7))
    assert_close(f"{study}: a 0-d metric, per row", per_row, scalar, rtol=1e-6, atol=1e-7)
    assert_close(f"{study}: rh.metrics", per_row, ours, rtol=1e-6, atol=1e-7)
    one = run(frozen, clean[0], corrupt[0], lambda logits: logits[0, -1, 5] - logits[0, -1, 7])
    assert_close(f"{study}: one pair, a 0-d metric", per_row[0], one, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("study", STUDIES)
@pytest.mark.parametrize(
    "metric, got",
    [
        (lambda logits: logits[:, -1], "a tensor of shape (2, 128)"),
        (lambda logits: logits[:1, -1, 5], "a tensor of shape (1,)"),
        (lambda logits: float(logits[0, -1, 5]), "float"),
        (lambda logits: [logits[0, -1, 5], logits[1, -1, 5]], "list"),
    ],
    ids=["a row of values per row", "too few values", "a Python float", "a list"],
)
def test_both_studies_refuse_the_same_metric_forms_with_one_message(model, study, metric, got):
    frozen = build("qwen3_5").requires_grad_(False)
    expected = (
        f"{study}: expected metric(logits) to return one value per row, a tensor of shape (2,) (or a 0-d"
        f" tensor, the value of one row) for logits of shape (2, {T}, 128), got {got}"
    )
    with pytest.raises(rh.InvalidValue) as error:
        STUDIES[study](frozen, random_ids(2, T, seed=1), random_ids(2, T, seed=2), metric)
    assert str(error.value).startswith(expected), str(error.value)


@pytest.mark.parametrize("study", STUDIES)
def test_an_error_in_a_metric_says_where(model, study):
    frozen = build("qwen3_5").requires_grad_(False)

    def metric(logits):
        return logits[:, -1, 500]  # outside the vocabulary

    with pytest.raises(IndexError) as error:
        STUDIES[study](frozen, random_ids(2, T, seed=1), random_ids(2, T, seed=2), metric)
    assert _notes(error)[-1].startswith(
        f"raised in the metric test_an_error_in_a_metric_says_where.<locals>.metric"
        f" of {study}, on logits of shape (2, {T}, 128)"
    ), _notes(error)
