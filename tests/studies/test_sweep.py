"""`patching_sweep`: many (layer, position) cells per forward equal one forward per cell through the public writes.

Two references, both a loop of one forward per cell that writes the clean memory with `set_memory_after`
(or `set_state_after`, `set_window_after`):

- bit for bit: with every kernel call on the library's token loop (`route_kernels(model, "torch")` for idle
  calls, `paths=rh.Paths(rule="loop")` for the others), and with each cell's forward at the batch shape the sweep
  gave it, reading the cell's row. Otherwise the two differ by the path each call takes, not by what
  they compute: one write at one token runs transformers' chunked kernel in two segments, hooks at many
  tokens run the token loop or more segments, and a layer that patches only some rows of a batch runs its
  token loop for the other rows too, where one forward per cell leaves that layer idle. The shape matters because CPU
  matrix products round by batch size: the unwatched tiny qwen3_5 gives other bits at batch 1 than at batch 2.
  Mixture-of-experts layers group tokens by expert across rows, so a row's bits also depend on the other rows: the
  kimi_linear model of this check has dense MLPs.
- within float32 rounding: the default kernels, one prompt (batch 1) per forward, as a user would write it.

The sweeps that test the batches of cells, the rounds of clean memories and the bits ask for one forward per cell
(`reuse_prefix=False`); where the kinds continue a cache, the default runs each cell from the corrupt run's cache
(tests/studies/test_sweep_from_cache.py), and the comparisons within float32 rounding here test that default.
"""

import weakref

import pytest
import torch
import transformers
from _compare import assert_close, assert_equal
from _models import _COMMON, _HYBRID_LAYERS, _KDA, _MLA, _make, build, random_ids

import recurrent_hooks as rh
import recurrent_hooks.studies.sweep as sweep_module
import recurrent_hooks.studies.sweep.cells as cells_module

T, BATCH = 10, 7  # 7 cells per forward: batches mix two layers and the last one is short
WHAT = ("memory", "state", "window")  # what a sweep patches, as its result's `memory` says
MEMORY = {"memory": None, "state": "state", "window": "window"}  # ... and the `memory=` that asks for it


def kimi_linear_dense():
    """tests/helpers/_models.py's kimi_linear, with dense MLPs in every layer (no rows coupled by expert routing)."""
    torch.manual_seed(0)
    return _make(
        transformers.KimiLinearConfig,
        transformers.KimiLinearForCausalLM,
        **_COMMON,
        **_MLA,
        **_KDA,
        intermediate_size=64,
        layer_types=list(_HYBRID_LAYERS),
        mlp_layer_types=["dense"] * 4,
        q_lora_rank=None,
        qk_rope_head_dim=8,
    ).eval()


FAMILIES = {
    "qwen3_5": lambda: build("qwen3_5"),
    "kimi_linear": kimi_linear_dense,
    "mamba": lambda: build("mamba"),
    "zamba": lambda: build("zamba"),
    "mamba2": lambda: build("mamba2"),
}


def metric(logits):
    """log p(token 5) at the last position, per row."""
    return logits[:, -1].log_softmax(-1)[:, 5]


def prompts():
    return random_ids(1, T, seed=1), random_ids(1, T, seed=2)


LOOP = rh.Paths(rule="loop")  # every busy call through the token loop


def loop_reference(model, clean, corrupt, what, batch_size=None, paths=None):
    """One forward per (layer, position), through the public writes; `batch_size`: run each cell at the
    batch shape `patching_sweep(batch_size=...)` gives it and read its row (None: one prompt per forward);
    `paths`: the watches' policy."""
    with rh.watch(model, keep=("states", "windows"), paths=paths) as a, torch.no_grad():
        model(clean, use_cache=False)
    mixers = a.mixers
    cells = [(i, p) for i in range(len(mixers)) for p in range(T)]
    out = torch.empty(len(mixers), T)
    for c, (i, p) in enumerate(cells):
        rows, row = (
            (1, 0)
            if batch_size is None
            else (min(batch_size, len(cells) - c // batch_size * batch_size), c % batch_size)
        )
        state, window = (x.expand(rows, *x.shape[1:]).contiguous() for x in mixers[i].memory_after(p))
        with rh.watch(model, paths=paths) as w, torch.no_grad():
            mixer = w.mixer(mixers[i].layer)
            if what == "memory":
                mixer.set_memory_after(p, rh.Memory(state, window))
            elif what == "state":
                mixer.set_state_after(p, state)
            else:
                mixer.set_window_after(p, window)
            out[i, p] = metric(model(corrupt.expand(rows, T), use_cache=False).logits)[row]
    return out, [m.layer for m in mixers]


@pytest.mark.parametrize("family", FAMILIES)
def test_the_batched_sweep_equals_the_loop_of_public_writes_bit_for_bit(family):
    model = FAMILIES[family]()
    clean, corrupt = prompts()
    rh.route_kernels(model, "torch")
    try:
        for what in WHAT:
            expected, layers = loop_reference(model, clean, corrupt, what, batch_size=BATCH, paths=LOOP)
            sweep = rh.patching_sweep(
                model,
                clean[0],
                corrupt[0],
                metric,
                memory=MEMORY[what],
                batch_size=BATCH,
                progress=False,
                paths=LOOP,
                reuse_prefix=False,
            )
            assert sweep.layers == tuple(layers) and sweep.positions == tuple(range(T)) and sweep.memory == what
            assert_equal(f"{family}, what={what}: batched sweep vs one forward per cell", expected, sweep.values)
            assert (sweep.values - sweep.corrupt).abs().max() > 1e-4, f"{family}, what={what}: patching changed nothing"
    finally:
        rh.route_kernels(model, "default")


@pytest.mark.parametrize("family", [*FAMILIES, "kimi_linear (moe)"])
def test_the_batched_sweep_matches_one_prompt_per_forward_with_the_default_kernels(family):
    model = build("kimi_linear") if family == "kimi_linear (moe)" else FAMILIES[family]()
    clean, corrupt = prompts()
    for what in WHAT:
        expected, _ = loop_reference(model, clean, corrupt, what)
        sweep = rh.patching_sweep(
            model, clean[0], corrupt[0], metric, memory=MEMORY[what], batch_size=BATCH, progress=False
        )
        assert_close(
            f"{family}, what={what}: batched sweep vs one prompt per forward",
            expected,
            sweep.values,
            rtol=1e-5,
            atol=1e-6,
        )
        with torch.no_grad():
            assert_equal("the corrupt baseline", metric(model(corrupt, use_cache=False).logits)[0], sweep.corrupt)
        # the last position: nothing comes after it, so the patched runs are the corrupt run
        assert_close(
            "a patch after the last token",
            sweep.corrupt.expand(len(sweep.layers)),
            sweep.values[:, -1],
            rtol=1e-6,
            atol=1e-6,
        )


def test_a_hybrid_sweeps_its_recurrent_layers_only_and_subsets_keep_their_order():
    model = build("qwen3_5")  # layers [linear, full, linear, full]
    clean, corrupt = prompts()
    full = rh.patching_sweep(model, clean[0], corrupt[0], metric, batch_size=BATCH, progress=False)
    assert full.layers == (0, 2) and full.values.shape == (2, T)
    with torch.no_grad():
        assert_equal("the clean baseline", metric(model(clean, use_cache=False).logits)[0], full.clean)
    part = rh.patching_sweep(
        model, clean[0], corrupt[0], metric, layers=[2], positions=[6, -1, 3], batch_size=2, progress=False
    )
    assert part.layers == (2,) and part.positions == (6, T - 1, 3)
    assert_close("a subset of cells", full.values[1:, [6, T - 1, 3]], part.values, rtol=1e-5, atol=1e-6)
    assert_close("normalized", (part.values - part.corrupt) / (part.clean - part.corrupt), part.normalized())


def test_the_progress_bar_can_be_shown(capsys):
    model = build("mamba")
    clean, corrupt = prompts()
    rh.patching_sweep(model, clean[0], corrupt[0], metric, positions=[1, 2], batch_size=2, progress=True)
    assert "patching_sweep" in capsys.readouterr().err


def test_bad_arguments_raise_invalid_value_naming_what_was_expected_and_what_came():
    model = build("qwen3_5")
    clean, corrupt = prompts()

    def sweep(**kw):
        return rh.patching_sweep(
            model,
            kw.pop("clean", clean[0]),
            kw.pop("corrupt", corrupt[0]),
            kw.pop("metric", metric),
            progress=False,
            **kw,
        )

    cases = [
        (
            dict(layers=[1]),
            r"patching_sweep: expected layers among the recurrent layers \[0, 2\] \(attention layers"
            r" cannot be patched\), got layer 1",
        ),
        (dict(layers=[0, 0]), r"expected each layer once, got layer 0 twice"),
        (dict(layers=1.0), r"expected layer as an int, got float 1.0"),
        (
            dict(positions=[T]),
            rf"expected positions in 0..{T - 1} \(or -{T}..-1\) of the {T}-token prompt,"
            rf" got position {T}",
        ),
        (dict(positions=[3, -7]), r"expected each position once, got position 3 twice"),
        (dict(positions=[]), r"expected positions as an int or a non-empty list of ints, got \[\]"),
        (
            dict(memory="states"),
            r"expected memory= None \(the whole memory\), 'state' or 'window',"
            r" got memory='states'",
        ),
        (
            dict(memory="memory"),
            r"expected memory= None \(the whole memory\), 'state' or 'window',"
            r" got memory='memory'",
        ),
        (dict(memory="state", what="state"), r"`what` is the former name of `memory`"),
        (dict(batch_size=0), r"expected batch_size >= 1 \(or None: chosen from the shapes\), got batch_size=0"),
        (dict(budget_bytes=-1), r"expected budget_bytes >= 0 \(or None: 268435456\), got budget_bytes=-1"),
        (dict(budget_bytes=1.5), r"expected budget_bytes as an int, got float 1.5"),
        (
            dict(metric=lambda logits: logits[:, -1]),
            r"expected metric\(logits\) to return one value per row,"
            r" a tensor of shape \(1,\) \(or a 0-d tensor, the value of one"
            r" row\) for logits of shape \(1, 10, 128\), got a tensor of"
            r" shape \(1, 128\)",
        ),
        (dict(metric="logit"), r"expected metric as a callable"),
        (
            dict(corrupt=corrupt[0, :-1]),
            r"expected clean_ids and corrupt_ids of the same length \(positions are"
            r" shared\), got shapes \(1, 10\) and \(1, 9\)",
        ),
        (
            dict(clean=clean.float()[0]),
            r"expected clean_ids as an integer tensor of token ids, \[seq\] \(one pair\)"
            r" or \[pairs, seq\], got a torch.float32 tensor",
        ),
        (
            dict(clean=clean[None]),
            r"expected clean_ids of shape \[seq\] \(one pair\) or \[pairs, seq\] \(the sweep"
            r" makes the batch\), got shape \(1, 1, 10\)",
        ),
        (
            dict(clean=clean.expand(2, T), corrupt=corrupt),
            r"expected clean_ids and corrupt_ids of one shape"
            r" \[pairs, seq\], got shapes \(2, 10\) and \(1, 10\)",
        ),
        (dict(forward_kwargs=[("use_cache", False)]), r"expected forward_kwargs as a mapping"),
        (
            dict(forward_kwargs={"attention_mask": torch.ones(1, T, dtype=torch.long)}),
            r"forward_kwargs\['attention_mask'\] is a tensor of shape \(1, 10\); expected keyword arguments without"
            r" per-row or per-token tensors",
        ),
    ]
    for kwargs, message in cases:
        with pytest.raises(rh.InvalidValue, match=message):
            sweep(**kwargs)
    with pytest.raises(rh.InvalidValue, match=r"expected progress=True or progress=False, got progress='yes'"):
        rh.patching_sweep(model, clean[0], corrupt[0], metric, progress="yes")
    with pytest.raises(rh.InvalidValue, match=r"expected a torch.nn.Module \(a transformers model\), got str"):
        rh.patching_sweep("model", clean, corrupt, metric)


def cell_bytes(model, clean):
    """The bytes of one cell's clean memory (the state and the window after a token, batch 1) per recurrent layer."""
    with rh.watch(model, keep=("states", "windows")) as w, torch.no_grad():
        model(clean, use_cache=False)
    return {m.layer: sum(x.nbytes for x in m.memory_after(0) if x is not None) for m in w.mixers}


class HeldMemories:
    """A spy on the clean memories the sweep keeps: every clone its read hooks make is counted while alive
    (`weakref.finalize`), and `peak` is the most bytes alive at once."""

    def __init__(self, monkeypatch):
        self.live = self.peak = 0
        real = cells_module.map_parts

        def spied(fn, *parts):
            out = real(fn, *parts)
            if fn is torch.clone:
                real(self._track, out)
            return out

        monkeypatch.setattr(cells_module, "map_parts", spied)

    def _track(self, part):
        self.live += part.nbytes
        self.peak = max(self.peak, self.live)
        weakref.finalize(part, self._freed, part.nbytes)
        return part

    def _freed(self, nbytes):
        self.live -= nbytes


@pytest.mark.parametrize("budget", [0, "3 batches"])
def test_the_clean_memories_held_at_once_are_bounded_by_the_budget_whatever_the_number_of_positions(
    monkeypatch, budget
):
    model = build("qwen3_5")  # 2 recurrent layers of the same size
    batch, peaks = 3, []
    for tokens in (10, 30):
        clean, corrupt = random_ids(1, tokens, seed=1), random_ids(1, tokens, seed=2)
        per_cell = max(cell_bytes(model, clean).values())
        allowed = batch * per_cell if budget == 0 else 3 * batch * per_cell
        held = HeldMemories(monkeypatch)
        sweep = rh.patching_sweep(
            model,
            clean[0],
            corrupt[0],
            metric,
            batch_size=batch,
            progress=False,
            budget_bytes=0 if budget == 0 else allowed,
            reuse_prefix=False,
        )
        assert sweep.values.shape == (2, tokens)
        assert 0 < held.peak <= allowed, (
            f"T={tokens}, budget {budget}: {held.peak} bytes of clean memories held at"
            f" once, allowed {allowed} ({per_cell} a cell)"
        )
        assert held.live == 0, f"T={tokens}: {held.live} bytes of clean memories outlive the sweep"
        peaks.append(held.peak)
    assert peaks[0] == peaks[1], f"budget {budget}: the memory held grows with the positions: {peaks}"


def test_a_sweep_in_rounds_equals_the_sweep_in_one_round_bit_for_bit():
    model = build("qwen3_5")
    clean, corrupt = prompts()
    rh.route_kernels(model, "torch")
    try:
        for what in WHAT:
            one = rh.patching_sweep(
                model,
                clean[0],
                corrupt[0],
                metric,
                memory=MEMORY[what],
                batch_size=BATCH,
                progress=False,
                paths=LOOP,
                reuse_prefix=False,
            )
            rounds = rh.patching_sweep(
                model,
                clean[0],
                corrupt[0],
                metric,
                memory=MEMORY[what],
                batch_size=BATCH,
                progress=False,
                paths=LOOP,
                budget_bytes=0,
                reuse_prefix=False,
            )
            assert_equal(f"what={what}: one batch per clean forward vs all in one", one.values, rounds.values)
    finally:
        rh.route_kernels(model, "default")


def test_the_default_batch_is_the_budget_of_a_batch_over_the_bytes_of_a_cell(monkeypatch):
    model = build("qwen3_5")
    clean, corrupt = prompts()
    per_cell = max(cell_bytes(model, clean).values())
    rows = []

    def counting(logits):
        rows.append(logits.shape[0])
        return metric(logits)

    # at Qwen3.5 dims (32 value heads of 128 x 128, a window of 8192 channels x 4): batch 1; tiny models: 32
    assert sweep_module._default_batch_size(32 * 128 * 128 * 4 + 8192 * 4 * 4) == 1
    assert sweep_module._default_batch_size(per_cell) == sweep_module.MAX_BATCH == 32
    for batch_bytes, expected in ((sweep_module.BATCH_BYTES, 2 * T), (3 * per_cell, 3), (per_cell - 1, 1)):
        rows.clear()
        monkeypatch.setattr(sweep_module, "BATCH_BYTES", batch_bytes)
        rh.patching_sweep(model, clean[0], corrupt[0], counting, progress=False, reuse_prefix=False)
        assert rows[2:] == [expected] * (2 * T // expected) + [2 * T % expected] * bool(2 * T % expected), (
            f"BATCH_BYTES={batch_bytes}, {per_cell} bytes a cell: forwards of {rows[2:]} rows"
        )
