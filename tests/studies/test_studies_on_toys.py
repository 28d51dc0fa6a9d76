"""The research layer on the shipped toys: the patching sweep finds the binding, attribution agrees with it.

On an MQAR contrast pair (one queried pair's value differs), patching the clean memory after a token
into the corrupt run can only restore the clean answer once that token has seen the changed value: the
hot cells start at the value's position and last until the query. Attribution patching, from one
backward, must rank the cells as the exact sweep does.
"""

import pytest
import torch

import recurrent_hooks as rh
from recurrent_hooks.toys import MQAR, TOYS, load_toy

STATE_RECALL = [name for name in ("mamba2", "gdn_recall") if name in TOYS]  # toys whose recall is in the state
PAIRS = 6


@pytest.fixture(scope="module", params=STATE_RECALL)
def toy(request):
    return MQAR(), load_toy(request.param)


def _cases(task):
    clean, corrupt = task.contrast(PAIRS, seed=7)
    query = int(task.answer_positions[-1])
    for b in range(PAIRS):
        value = int(task.value_positions[clean.query_pairs[b, -1]])
        right, wrong = int(clean.answers[b, -1]), int(corrupt.answers[b, -1])

        def metric(logits, right=right, wrong=wrong):
            return logits[:, query, right] - logits[:, query, wrong]

        yield clean.ids[b : b + 1, : query + 1], corrupt.ids[b : b + 1, : query + 1], metric, value, query


def test_the_sweep_finds_the_binding_at_the_changed_value(toy):
    task, model = toy
    for clean, corrupt, metric, value, query in _cases(task):
        sweep = rh.patching_sweep(model, clean[0], corrupt[0], metric, progress=False)
        assert sweep.clean > sweep.corrupt, "the corrupt run should prefer the corrupt answer less than the clean run"
        effect = sweep.normalized()  # [layers, positions]: 0 no effect, 1 the clean answer restored
        assert effect[:, :value].abs().max() < 0.05, f"cells before the changed value (token {value}) matter:\n{effect}"
        assert effect[:, value:query].sum(0).min() > 0.5, f"cells after the value (token {value}) do not:\n{effect}"


def test_attribution_ranks_the_cells_as_the_exact_sweep(toy):
    task, model = toy
    for clean, corrupt, metric, value, query in _cases(task):
        sweep = rh.patching_sweep(model, clean[0], corrupt[0], metric, progress=False)
        estimate = rh.attribute(model, clean, corrupt, metric, forward_kwargs={"use_cache": False})
        assert estimate.layers == sweep.layers
        exact = (sweep.values - sweep.corrupt).flatten()
        correlation = torch.corrcoef(torch.stack([exact, estimate.memory.flatten()]))[0, 1]
        assert correlation >= 0.9, f"attribution vs sweep: correlation {correlation:.3f} (value at token {value})"
        assert abs(estimate.clean - float(sweep.clean)) < 1e-4 and abs(estimate.corrupt - float(sweep.corrupt)) < 1e-4
