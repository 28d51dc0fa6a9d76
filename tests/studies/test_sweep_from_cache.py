"""`patching_sweep` from the corrupt run's cache (`reuse_prefix`, studies/sweep/prefix.py).

Cells at position p share the corrupt run up to p. Where every chosen layer's kind continues a cached memory in a
multi-token call (`CONTINUES_CACHE`) and its memories are the cache's tensors, the clean and corrupt prompts run once
in pieces, and each cell runs only tokens p + 1.. from a copy of the corrupt cache with its layer's clean memory
written into its row. Reference: one forward per cell (`reuse_prefix=False`, itself tested against the public
writes in tests/studies/test_sweep.py); the two take other kernel paths, so they agree within float32 rounding.
"""

from types import SimpleNamespace

import pytest
import torch
from _compare import assert_close, assert_equal
from _models import FAMILIES, build, random_ids

import recurrent_hooks as rh
import recurrent_hooks.studies.sweep as sweep_module
from recurrent_hooks.studies.ranks import Ranks

T = 8
TOLERANCE = dict(rtol=1e-5, atol=2e-6)
SEVERAL_MIXERS_A_LAYER = ("inkling", "inkling2", "inkling2_loop")  # short convolutions of q, k, v... per layer


def metric(logits):
    """log p(token 5) at the last position, per row."""
    return logits[:, -1].log_softmax(-1)[:, 5]


def prompts(pairs=None):
    shape = (1 if pairs is None else pairs, T)
    clean, corrupt = random_ids(*shape, seed=1), random_ids(*shape, seed=2)
    return (clean[0], corrupt[0]) if pairs is None else (clean, corrupt)


def continues(model) -> bool:
    with rh.watch(model) as w:
        return all(type(mixer).CONTINUES_CACHE for mixer in w.mixers)


@pytest.mark.one_per_kind
@pytest.mark.parametrize("family", FAMILIES)
def test_a_family_sweeps_from_the_corrupt_cache_where_its_kind_continues_one(family):
    model = build(family)
    clean, corrupt = prompts()
    if family in SEVERAL_MIXERS_A_LAYER:  # a cell is a layer's memory: both paths refuse these models alike
        for reuse in (False, None, True):
            with pytest.raises(rh.Unavailable, match=r"patching_sweep: layers \[.*\] have several mixers each"):
                rh.patching_sweep(model, clean, corrupt, metric, progress=False, reuse_prefix=reuse)
        return
    expected = rh.patching_sweep(model, clean, corrupt, metric, progress=False, reuse_prefix=False)
    assert (expected.values - expected.corrupt).abs().max() > 1e-6, f"{family}: patching changed nothing"
    if continues(model):
        got = rh.patching_sweep(model, clean, corrupt, metric, progress=False, reuse_prefix=True)
        assert_close(
            f"{family}: from the corrupt cache vs one forward per cell", expected.values, got.values, **TOLERANCE
        )
        assert_equal(f"{family}: the baselines", expected.corrupt, got.corrupt)
    else:
        with pytest.raises(
            rh.InvalidValue,
            match=r"reuse_prefix=True runs each cell from the corrupt run's cache,"
            r" which needs transformers to continue every layer's memory"
            r" from a cache; here: .*CONTINUES_CACHE",
        ):
            rh.patching_sweep(model, clean, corrupt, metric, progress=False, reuse_prefix=True)
        by_default = rh.patching_sweep(model, clean, corrupt, metric, progress=False)
        assert_equal(f"{family}: the default takes one forward per cell", expected.values, by_default.values)


@pytest.mark.parametrize(
    "family, what",
    [
        ("qwen3_5", "state"),
        ("qwen3_5", "window"),
        ("kimi_linear", "state"),
        ("mamba2", "state"),
        ("mamba2", "window"),
        ("zaya", "state"),
        ("zaya", "window"),
    ],
)
def test_a_state_or_a_window_alone_is_patched_in_the_cache(family, what):
    model = build(family)
    clean, corrupt = prompts()
    expected = rh.patching_sweep(model, clean, corrupt, metric, memory=what, progress=False, reuse_prefix=False)
    got = rh.patching_sweep(model, clean, corrupt, metric, memory=what, progress=False, reuse_prefix=True)
    assert_close(f"{family}, what={what}", expected.values, got.values, **TOLERANCE)


@pytest.mark.parametrize("keep", [1, 3, T + 2])
def test_logits_to_keep_gives_the_metric_the_same_positions(keep):
    model = build("qwen3_5")
    clean, corrupt = prompts()
    seen = []

    def last(logits):
        seen.append(logits.shape[1])
        return logits[:, -1].log_softmax(-1)[:, 5]

    kwargs = {"forward_kwargs": {"logits_to_keep": keep}, "progress": False}
    expected = rh.patching_sweep(model, clean, corrupt, last, reuse_prefix=False, **kwargs)
    seen.clear()
    got = rh.patching_sweep(model, clean, corrupt, last, reuse_prefix=True, **kwargs)
    assert set(seen) == {min(keep, T)}, f"logits_to_keep={keep}: the metric got {sorted(set(seen))} positions"
    assert_close(f"logits_to_keep={keep}", expected.values, got.values, **TOLERANCE)


@pytest.mark.parametrize("per", ["rows", "pair"])
def test_many_pairs_share_the_pieces_of_their_prompts(per):
    model = build("mamba2")
    clean, corrupt = prompts(pairs=3)
    shared = rh.metrics.logit_difference(torch.tensor([3, 6, 9]), wrong=4)
    chosen = shared if per == "rows" else PairOnly(shared)
    expected = rh.patching_sweep(model, clean, corrupt, chosen, progress=False, reuse_prefix=False)
    got = rh.patching_sweep(model, clean, corrupt, chosen, batch_size=4, progress=False, reuse_prefix=True)
    assert got.values.shape == (3, 2, T)
    assert_close(f"3 pairs, a metric per {per}", expected.values, got.values, **TOLERANCE)


class PairOnly:
    """A metric with `for_pair` and no `for_rows`: a batch holds one pair's cells."""

    def __init__(self, inner):
        self.for_pair = inner.for_pair

    def __call__(self, logits):
        raise AssertionError("a metric with only for_pair is called through it")


def test_each_cell_runs_only_the_tokens_after_its_position():
    model = build("qwen3_5")  # 2 recurrent layers
    clean, corrupt = prompts()
    tokens = []
    count = lambda module, args, kwargs: tokens.append((args or [kwargs.get("input_ids")])[0].numel())  # noqa: E731
    handle = model.register_forward_pre_hook(count, with_kwargs=True)
    try:
        rh.patching_sweep(model, clean, corrupt, metric, progress=False)
    finally:
        handle.remove()
    probe, baselines, pieces = 2 * 1, 2 * T, 2 * T  # the probe's token (watched, then with a cache); clean + corrupt
    cells = 2 * sum(T - p - 1 for p in range(T))  # 2 layers; a cell at p runs tokens p + 1..
    assert sum(tokens) == probe + baselines + pieces + cells, f"tokens per forward: {tokens}"


def test_a_sweep_from_the_cache_resumes_from_its_checkpoint(tmp_path):
    model = build("mamba2")
    clean, corrupt = prompts(pairs=2)
    whole = rh.patching_sweep(model, clean, corrupt, METRIC, batch_size=4, progress=False)
    path = tmp_path / "sweep.pt"
    with pytest.raises(KeyboardInterrupt):  # the baselines, three batches, then stopped
        rh.patching_sweep(
            model, clean, corrupt, Rows(METRIC, [], stop_at=2 + 3), batch_size=4, progress=False, checkpoint=path
        )
    saved = torch.load(path, weights_only=True)
    assert 0 < int(saved["done"].sum()) < saved["done"].numel(), "some cells were saved, not all"
    resumed = Rows(METRIC, [])
    result = rh.patching_sweep(model, clean, corrupt, resumed, batch_size=4, progress=False, checkpoint=path)
    assert sum(resumed.calls[2:]) == saved["done"].numel() - int(saved["done"].sum()), "only the cells left run"
    assert_close("the resumed sweep vs one run", whole.values, result.values, **TOLERANCE)


METRIC = rh.metrics.logit_difference(torch.tensor([3, 6]), wrong=4)


class Rows:
    """A metric that records the rows of each forward (`calls`) and stops the sweep at call `stop_at`."""

    def __init__(self, inner, calls, stop_at=None):
        self.inner, self.calls, self.stop_at = inner, calls, stop_at

    def for_rows(self, pairs):
        return Rows(self.inner.for_rows(pairs), self.calls, self.stop_at)

    def __call__(self, logits):
        if len(self.calls) == self.stop_at:
            raise KeyboardInterrupt
        self.calls.append(logits.shape[0])
        return self.inner(logits)


def test_what_the_path_needs_is_said_when_it_is_asked_for(monkeypatch):
    model = build("qwen3_5")
    clean, corrupt = prompts()
    sweep = lambda **kw: rh.patching_sweep(model, clean, corrupt, metric, progress=False, **kw)  # noqa: E731
    with pytest.raises(
        rh.InvalidValue,
        match=r"expected reuse_prefix=True or reuse_prefix=False or"
        r" reuse_prefix=None, got reuse_prefix='yes'",
    ):
        sweep(reuse_prefix="yes")
    with pytest.raises(
        rh.InvalidValue,
        match=r"here: heads=True patches a head's slice of a memory, which runs one"
        r" forward per cell",
    ):
        sweep(reuse_prefix=True, heads=True, positions=[3])
    with pytest.raises(rh.InvalidValue, match=r"here: forward_kwargs' logits_to_keep is Tensor, not an int"):
        sweep(reuse_prefix=True, forward_kwargs={"logits_to_keep": torch.tensor([0])})
    # a kind that says it continues a cache, but whose memory the cache holds in another layout: refused
    adapter = rh.GatedDeltaNet.adapter
    real = adapter.cached_memory
    transposed = lambda cache, where, memory: real(cache, where, memory).transpose(-1, -2)  # noqa: E731
    monkeypatch.setattr(adapter, "cached_memory", transposed)
    with pytest.raises(
        rh.InvalidValue,
        match=r"here: GatedDeltaNet\(qwen3_5, layer 0\): its state is not the cache's"
        r" tensor at 0",
    ):
        sweep(reuse_prefix=True)


def test_a_layer_that_is_not_swept_must_continue_the_cache_too(monkeypatch):
    """Every layer runs the cells' tokens from the corrupt cache, so one whose kind does not continue a cached memory
    refuses the path even when only other layers are swept (here: Mamba-2 declared not to, in a two-layer model)."""
    model = build("mamba2")
    clean, corrupt = prompts()
    monkeypatch.setattr(rh.Mamba2StateSpace, "CONTINUES_CACHE", False)
    with pytest.raises(
        rh.InvalidValue,
        match=r"Mamba2StateSpace\(mamba2, layer 0\): transformers' prompt calls of"
        r" Mamba2StateSpace do not continue a cached memory",
    ):
        rh.patching_sweep(model, clean, corrupt, metric, layers=[1], progress=False, reuse_prefix=True)


class OneRankOfTwo(Ranks):
    """Rank `rank` of two without a process group: `gathered` keeps this rank's own cells (the others stay 0)."""

    def gathered(self, values, done):
        return values, done

    def barrier(self):
        pass


@pytest.mark.parametrize("positions", [None, [3]], ids=["every position", "fewer positions than ranks"])
def test_ranks_take_whole_positions_and_run_the_pieces_of_their_own_only(monkeypatch, positions):
    """Under torchrun, the ranks of a sweep from the cache split it by position (scripts/sweep_ranks.py runs it in two
    gloo processes, tests/studies/test_distributed.py): here each rank of two in turn, in this process. Every cell of a
    position is one rank's (but for fewer positions than ranks: then the position's batches are shared out), and a
    rank runs its prompts up to its first position in one forward, then one piece to each next position of its own,
    and the batches of its cells."""
    model = build("mamba2")  # 2 layers; batch_size=1: a batch a cell, 2 a position
    clean, corrupt = prompts()
    forwards = []
    handle = model.register_forward_pre_hook(lambda module, args: forwards.append(1))

    def sweep():
        return rh.patching_sweep(
            model,
            clean,
            corrupt,
            metric,
            positions=positions,
            batch_size=1,
            progress=False,
            reuse_prefix=True,
        )

    try:
        alone = sweep()
        one_process, shares = len(forwards), []
        for rank in (0, 1):
            one_rank = SimpleNamespace(of=lambda *args, rank=rank: OneRankOfTwo(rank, 2))
            monkeypatch.setattr(sweep_module, "Ranks", one_rank)
            forwards.clear()
            got = sweep()
            mine = got.values != 0  # [layers, positions]: this rank's cells
            if positions is None:
                assert torch.equal(mine, mine.all(0).expand_as(mine)), f"rank {rank} took part of a position: {mine}"
            tails = mine[:, [p != T - 1 for p in got.positions]]  # a cell at the last position runs no forward
            expected = 2 + 2 + int(mine.any(0).sum()) + int(tails.sum())  # probe, baselines, pieces, batches
            assert len(forwards) == expected < one_process, (
                f"rank {rank}: {len(forwards)} forwards, one process {one_process}, expected {expected}"
            )
            shares.append(got.values)
    finally:
        handle.remove()
    assert torch.equal((shares[0] != 0) ^ (shares[1] != 0), torch.ones_like(alone.values, dtype=torch.bool)), (
        "the ranks' cells overlap or miss some"
    )
    assert_close("the ranks' cells vs one process", alone.values, shares[0] + shares[1], **TOLERANCE)


def test_the_pieces_carry_their_positions():
    """BambaModel numbers a forward's tokens from 0 when it is given no position ids, over a cache too: each piece
    and each cell's tail gets its own (it was 1e-5 off here, 0.06 at bamba's real size,
    tests/package/test_real_size.py)."""
    model = build("bamba")
    clean, corrupt = prompts()
    expected = rh.patching_sweep(model, clean, corrupt, metric, progress=False, reuse_prefix=False)
    got = rh.patching_sweep(model, clean, corrupt, metric, progress=False, reuse_prefix=True)
    assert_close(
        "bamba: from the corrupt cache vs one forward per cell", expected.values, got.values, rtol=0, atol=2e-6
    )
