"""Many prompt pairs at once: `attribute` over `[N, seq]` equals N single-pair calls stacked, per kind; and split into
groups of pairs by a memory budget, the same result."""

import pytest
import torch
from _compare import assert_close
from _models import build, random_ids

import recurrent_hooks as rh

FAMILIES = ["qwen3_5", "kimi_linear", "mamba", "zamba", "mamba2", "recurrent_gemma"]  # "pieces" x 5 kinds, "states"
PAIRS, TOKENS = 3, 11


@pytest.mark.parametrize("family", FAMILIES)
def test_attribute_over_pairs_equals_one_call_per_pair(family):
    model = build(family).requires_grad_(False)
    clean, corrupt = random_ids(PAIRS, TOKENS, seed=1), random_ids(PAIRS, TOKENS, seed=2)
    answers = torch.tensor([3, 5, 7])
    many = rh.attribute(model, clean, corrupt, rh.metrics.logit_difference(answers, wrong=4))
    assert many.state.shape[0] == many.window.shape[0] == many.clean.shape[0] == PAIRS
    for n in range(PAIRS):
        one = rh.attribute(model, clean[n], corrupt[n], rh.metrics.logit_difference(int(answers[n]), wrong=4))
        assert one.state.dim() == 2 and one.clean.dim() == 0  # one pair as [seq]: no pairs axis
        scale = one.memory.abs().max()
        for name in ("state", "window"):
            assert_close(f"pair {n} {name}", getattr(many, name)[n], getattr(one, name), rtol=1e-4, atol=1e-6 * scale)
        assert_close(
            f"pair {n} baselines",
            torch.stack([many.clean[n], many.corrupt[n]]),
            torch.stack([one.clean, one.corrupt]),
            rtol=1e-6,
            atol=1e-7,
        )
    assert_close("normalized", many.normalized()[1], many.memory[1] / (many.clean[1] - many.corrupt[1]), rtol=0, atol=0)


def test_one_pair_as_a_batch_keeps_the_pairs_axis():
    model = build("qwen3_5").requires_grad_(False)
    clean, corrupt = random_ids(1, TOKENS, seed=1), random_ids(1, TOKENS, seed=2)
    metric = rh.metrics.log_prob(3)
    batch, single = rh.attribute(model, clean, corrupt, metric), rh.attribute(model, clean[0], corrupt[0], metric)
    assert batch.state.shape == (1, *single.state.shape) and batch.clean.shape == (1,)
    assert_close("the same numbers", batch.memory[0], single.memory, rtol=0, atol=0)
    # a metric of one value for all rows is a metric of one row, called once per pair
    clean, corrupt = random_ids(3, TOKENS, seed=3), random_ids(3, TOKENS, seed=4)
    summed = rh.attribute(model, clean, corrupt, lambda logits: logits[:, -1, 3].sum())
    rows = rh.attribute(model, clean, corrupt, lambda logits: logits[:, -1, 3])
    assert_close("a 0-d metric, per pair", rows.memory, summed.memory, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("family", ["qwen3_5", "mamba", "mamba2"])
def test_patching_sweep_over_pairs_equals_one_sweep_per_pair(family):
    model = build(family).requires_grad_(False)
    clean, corrupt = random_ids(2, 8, seed=3), random_ids(2, 8, seed=4)
    answers = torch.tensor([3, 6])
    many = rh.patching_sweep(
        model, clean, corrupt, rh.metrics.logit_difference(answers, wrong=4), positions=[1, 5], progress=False
    )
    assert many.values.shape[0] == many.clean.shape[0] == 2
    for n in range(2):
        one = rh.patching_sweep(
            model,
            clean[n],
            corrupt[n],
            rh.metrics.logit_difference(int(answers[n]), wrong=4),
            positions=[1, 5],
            progress=False,
        )
        assert one.values.dim() == 2 and one.clean.dim() == 0
        # the pairs share batches (rows of both pairs, both clean prompts in one forward): CPU products round by
        # batch size, so within float32 rounding
        assert_close(f"pair {n}", many.values[n], one.values, rtol=1e-5, atol=1e-6)
        assert_close(
            f"pair {n} baselines",
            torch.stack([many.clean[n], many.corrupt[n]]),
            torch.stack([one.clean, one.corrupt]),
            rtol=1e-5,
            atol=1e-6,
        )
    assert_close(
        "normalized per pair",
        many.normalized()[1],
        (many.values[1] - many.corrupt[1]) / (many.clean[1] - many.corrupt[1]),
        rtol=0,
        atol=0,
    )


@pytest.mark.parametrize("family, method", [("qwen3_5", "pieces"), ("mamba2", "pieces"), ("recurrent_gemma", "states")])
def test_pairs_split_by_the_memory_budget_give_the_batch_result(family, method):
    """A budget that holds one pair's states (or two) runs the pairs in groups, each with its metric's rows
    (`for_rows`) and its rows of the per-pair forward_kwargs (a mask with left padding): the same terms as one
    batch. A plain metric is one metric for every pair."""
    model = build(family).requires_grad_(False)
    clean, corrupt = random_ids(PAIRS, TOKENS, seed=5), random_ids(PAIRS, TOKENS, seed=6)
    mask = torch.ones(PAIRS, TOKENS, dtype=torch.long)
    mask[1, :3] = 0  # pair 1 is left-padded
    kwargs = {"attention_mask": mask}
    per_pair = rh.metrics.logit_difference(torch.tensor([3, 5, 7]), wrong=4)
    whole = rh.attribute(model, clean, corrupt, per_pair, method=method, forward_kwargs=kwargs)
    plain = lambda logits: logits[:, -1, 3] - logits[:, -1, 4]  # noqa: E731
    whole_plain = rh.attribute(model, clean, corrupt, plain, method=method, forward_kwargs=kwargs)
    for budget, group in ((1, 1), (2 * TOKENS * _one_row_bytes(model) * 2, 2)):  # groups of one pair, of two
        for metric, expected in ((per_pair, whole), (plain, whole_plain)):
            batches = []
            handle = model.register_forward_pre_hook(
                lambda module, args, kwargs: batches.append(kwargs["attention_mask"].shape[0]), with_kwargs=True
            )
            try:
                split = rh.attribute(
                    model, clean, corrupt, metric, method=method, forward_kwargs=kwargs, budget_bytes=budget
                )
            finally:
                handle.remove()
            assert batches[0] == 1 and max(batches[1:]) == group, batches  # the probe's row, then the groups
            scale = expected.memory.abs().max()
            for name in ("state", "window"):
                assert_close(
                    f"{name}, budget {budget}",
                    getattr(expected, name),
                    getattr(split, name),
                    rtol=1e-4,
                    atol=1e-6 * scale,
                )
            assert_close(
                f"baselines, budget {budget}",
                torch.stack([expected.clean, expected.corrupt]),
                torch.stack([split.clean, split.corrupt]),
                rtol=1e-6,
                atol=1e-7,
            )


def _one_row_bytes(model) -> int:
    """The float32 bytes of one row's memory in the largest recurrent layer (what attribute's budget counts)."""
    with torch.no_grad(), rh.watch(model, keep={"states": [0], "windows": [0]}) as w:
        model(random_ids(1, 1))
    return max(
        4
        * sum(
            part.numel()
            for value in m.memory_after(0)
            if value is not None
            for part in (value if isinstance(value, tuple) else (value,))
        )
        for m in w.mixers
    )


def test_a_bad_budget_is_refused():
    model = build("qwen3_5").requires_grad_(False)
    ids = random_ids(2, TOKENS)
    with pytest.raises(
        rh.InvalidValue,
        match=r"attribute: expected budget_bytes as an int >= 0 \(or None: 268435456\),"
        r" got budget_bytes=-1",
    ):
        rh.attribute(model, ids, ids, rh.metrics.log_prob(3), budget_bytes=-1)
