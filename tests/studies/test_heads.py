"""`patching_sweep(heads=True)`: each (layer, head, position) cell equals one run with a hook that writes only that
head, per kind; and the window channels each kind declares for a head are the ones that head reads.

The channels that feed a head come from tests/helpers/_heads.py, written from the models' layouts.
"""

import pytest
import torch
from _compare import assert_close
from _heads import feeding
from _models import build, random_ids

import recurrent_hooks as rh

T, POSITIONS = 8, [1, 4]


def metric(logits):
    return logits[:, -1].log_softmax(-1)[:, 5]


def one_head_written(model, family, clean, corrupt, layer, head, position, what):
    """The metric of the corrupt prompt with only head `head` of layer `layer` patched after `position` by a hook."""
    with rh.watch(model, keep=("states", "windows")) as source, torch.no_grad():
        model(clean, use_cache=False)
    kept = source.mixer(layer)
    state = kept.state_after(position)
    with rh.watch(model) as w, torch.no_grad():
        mixer = w.mixer(layer)
        memories = [m for m in ("state", "window") if m in mixer.MEMORIES and what in ("memory", m)]
        for memory in memories:
            if memory == "window":
                window = kept.window_after(position)
                channels = feeding(family, model, layer, head, tuple(state.shape), window.shape[1])

                def write(m, call, token, s, window=window, channels=channels):
                    out = s.clone()
                    out[:, channels] = window[:, channels]
                    return out
            elif mixer.KERNEL_PER_HEAD:  # zamba: the hook runs once per head, with that head's state

                def write(m, call, token, s):
                    return state[:, head].clone() if m.head == head else s
            else:

                def write(m, call, token, s):
                    def one(part, clean_part):
                        out = part.clone()
                        out[:, head] = clean_part[:, head]
                        return out

                    if isinstance(s, torch.Tensor):
                        return one(s, state)
                    return type(s)(*(one(p, c) for p, c in zip(s, state)))

            mixer.register_state_hook(write, call=0, token=position, memory=memory)
        return metric(model(corrupt, use_cache=False).logits)[0]


CASES = [
    ("qwen3_5", "memory"),
    ("qwen3_5", "state"),
    ("qwen3_5", "window"),
    ("kimi_linear", "memory"),
    ("mamba2", "memory"),
    ("mamba2", "window"),
    ("zamba", "memory"),
    ("zamba", "state"),
    ("minimax", "state"),
    ("xlstm", "state"),
]


@pytest.mark.parametrize("family, what", CASES, ids=[f"{f}-{w}" for f, w in CASES])
def test_a_head_cell_equals_one_run_writing_only_that_head(family, what):
    model = build(family).requires_grad_(False)
    clean, corrupt = random_ids(1, T, seed=1), random_ids(1, T, seed=2)
    sweep = rh.patching_sweep(
        model,
        clean[0],
        corrupt[0],
        metric,
        memory=None if what == "memory" else what,
        heads=True,
        positions=POSITIONS,
        progress=False,
    )
    assert sweep.values.shape == (len(sweep.layers), sweep.heads, len(POSITIONS)) and sweep.heads >= 2
    expected = torch.empty_like(sweep.values)
    for i, layer in enumerate(sweep.layers):
        for head in range(sweep.heads):
            for j, position in enumerate(POSITIONS):
                expected[i, head, j] = one_head_written(model, family, clean, corrupt, layer, head, position, what)
    assert_close(
        f"{family}, what={what}: per-head cells vs one hooked run per head",
        expected,
        sweep.values,
        rtol=1e-5,
        atol=1e-6,
    )
    effects = (sweep.values - sweep.corrupt).abs()
    assert effects.amax(dim=(0, 2)).min() > 1e-5, f"{family}: a head whose patch changes nothing: {effects}"


@pytest.mark.parametrize("family", ["qwen3_5", "kimi_linear", "mamba2", "zamba"])
def test_the_declared_channels_are_the_ones_a_head_reads(family):
    """Writing the clean window everywhere but head h's declared channels leaves head h's kernel output unchanged;
    writing its channels changes it."""
    model = build(family).requires_grad_(False)
    clean, corrupt = random_ids(1, T, seed=1), random_ids(1, T, seed=2)
    position, output = 2, "y" if family in ("mamba2", "zamba") else "output"
    with rh.watch(model, keep=("states", "windows")) as source, torch.no_grad():
        model(clean, use_cache=False)
    kept = source.mixers[0]
    window, heads = kept.window_after(position), kept.state_after(position).shape[1]

    def head_outputs(channels):
        with rh.watch(model, keep=("inputs", "outputs")) as w, torch.no_grad():
            if channels is not None:

                def write(m, call, token, s):
                    out = s.clone()
                    out[:, channels] = window[:, channels]
                    return out

                w.mixers[0].register_state_hook(write, call=0, token=position, memory="window")
            model(corrupt, use_cache=False)
        return w.mixers[0].values()[output][0]  # seq heads ...

    plain = head_outputs(None)
    for head in range(heads):
        declared = feeding(family, model, kept.layer, head, tuple(kept.state_after(position).shape), window.shape[1])
        library = kept.adapter.head_channels(head, heads, tuple(kept.state_after(position).shape[2:]), window.shape[1])
        assert list(library) == declared, f"{family} head {head}: the kind declares {list(library)}"
        others = [c for c in range(window.shape[1]) if c not in declared]
        assert_close(
            f"{family} head {head}: its output with the other channels written",
            plain[:, head],
            head_outputs(others)[:, head],
            rtol=0,
            atol=1e-7,
        )
        changed = (head_outputs(declared)[position + 1 :, head] - plain[position + 1 :, head]).abs().max()
        assert changed > 1e-5, f"{family} head {head}: writing its own channels changed nothing ({changed})"


def test_heads_are_refused_where_a_layer_has_none():
    model = build("mamba")
    clean, corrupt = random_ids(1, T, seed=1), random_ids(1, T, seed=2)
    with pytest.raises(
        rh.InvalidValue,
        match=r"heads=True needs a state with heads in every chosen layer;"
        r" SelectiveScan\(mamba, layer 0\) has a state of axes"
        r" 'batch d_inner d_state' without heads",
    ):
        rh.patching_sweep(model, clean[0], corrupt[0], metric, heads=True, progress=False)
    with pytest.raises(rh.InvalidValue, match=r"expected heads=True or heads=False, got heads=1"):
        rh.patching_sweep(model, clean[0], corrupt[0], metric, heads=1, progress=False)


def test_per_head_results_keep_the_pairs_axis_and_save(tmp_path):
    model = build("qwen3_5").requires_grad_(False)
    clean, corrupt = random_ids(2, T, seed=1), random_ids(2, T, seed=2)
    metric_ = rh.metrics.logit_difference(torch.tensor([3, 5]), wrong=4)
    sweep = rh.patching_sweep(model, clean, corrupt, metric_, heads=True, positions=POSITIONS, progress=False)
    assert sweep.values.shape == (2, 2, 4, len(POSITIONS)) and sweep.heads == 4
    one = rh.patching_sweep(
        model,
        clean[1],
        corrupt[1],
        rh.metrics.logit_difference(5, wrong=4),
        heads=True,
        positions=POSITIONS,
        progress=False,
    )
    assert_close("pair 1 vs its own sweep", one.values, sweep.values[1], rtol=1e-5, atol=1e-6)
    expected = (sweep.values - sweep.corrupt[:, None, None, None]) / (sweep.clean - sweep.corrupt)[:, None, None, None]
    assert_close("normalized per pair", expected, sweep.normalized(), rtol=0, atol=0)
    torch.save(sweep.to_dict(), tmp_path / "sweep.pt")
    loaded = rh.Sweep.from_dict(torch.load(tmp_path / "sweep.pt", weights_only=True))
    assert loaded.heads == 4 and torch.equal(loaded.values, sweep.values)
