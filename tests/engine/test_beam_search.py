"""Beam search, for one family of each kind with chunk-wise maths: between decode steps it reorders the cache rows,
each decode call's record says how (`call.reorder`, None on the prompt), and each decode step's kept states are the
float64 recurrence continued from the previous step's states, reordered (the references of
tests/kinds/test_families.py, run on the step's own kernel inputs)."""

import pytest
import torch
from _compare import assert_close
from _contract import in_segments, one_family_per_kind
from _kernel_references import REFERENCES
from _models import build, random_ids
from _runs import greedy_exactly as greedy

import recurrent_hooks as rh

ONE_PER_KIND = one_family_per_kind(in_segments)  # the kinds with chunk-wise maths


@pytest.mark.parametrize("family", ONE_PER_KIND)
def test_beam_search_decode_states_continue_the_reordered_rows(family):
    """Between decode steps beam search reorders the cache rows; `call.reorder` says how, and each decode step's
    kept states equal the float64 recurrence continued from the previous step's states, reordered."""
    model = build(family)
    with rh.watch(model, keep=("states", "inputs")) as w:
        greedy(model, random_ids(2, 9), 5, num_beams=3)
    for mixer in w.mixers:
        calls = mixer.calls
        assert calls[0].reorder is None and all(c.reorder is not None and c.reorder.shape == (6,) for c in calls[1:])
        assert any(not torch.equal(c.reorder, torch.arange(6)) for c in calls[1:]), "no beam was ever reordered"
        for k in range(1, len(calls)):
            before = mixer.state_after(-1, call=k - 1)[calls[k].reorder]
            assert_close(f"{mixer} call {k}: state in", before, _state_in(mixer, k), rtol=0, atol=0)
            assert_close(
                f"{mixer} call {k}: state",
                _reference_step(mixer, k, before),
                mixer.state_after(0, call=k),
                rtol=1e-4,
                atol=1e-6,
            )


def _state_in(mixer, k):
    parts = mixer.calls[k].kernel_calls
    name = type(mixer).kernel(mixer.calls[k].kernel).state_in
    states = [part.inputs[name] for part in parts]
    return states[0] if len(states) == 1 else torch.stack(states, dim=1)


def _reference_step(mixer, k, start):
    """The float64 state after decode step k from `start`, from the step's own kernel inputs."""
    parts = []
    for h, part in enumerate(mixer.calls[k].kernel_calls):
        x = dict(part.inputs)
        name = type(mixer).kernel(part.kernel).state_in
        x[name] = start if len(mixer.calls[k].kernel_calls) == 1 else start[:, h]
        for kind, reference in REFERENCES.items():
            if type(mixer) is kind:
                parts.append(reference(rh.KernelCall(part.kernel, x, None))[:, 0])
    return parts[0] if len(parts) == 1 else torch.stack(parts, dim=1)
