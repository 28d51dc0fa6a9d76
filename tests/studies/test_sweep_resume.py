"""`patching_sweep` at scale in one process: pairs share batches, a checkpoint lets a stopped sweep resume, and
`distributed=` says what it needs (the split across processes: tests/studies/test_distributed.py)."""

import pytest
import torch
from _compare import assert_close
from _models import build, random_ids

import recurrent_hooks as rh

T = 8


class Stopped(Exception):
    pass


class Counting:
    """A metric that records the rows of each forward and raises `Stopped` at forward `stop_at`; `pair_only`:
    it has `for_pair` and no `for_rows` (a batch then holds one pair's cells)."""

    def __init__(self, inner, stop_at=None, rows=None, pair_only=False):
        self.inner, self.stop_at, self.rows = inner, stop_at, rows if rows is not None else []
        if pair_only:
            self.for_pair = lambda n: Counting(inner.for_pair(n), stop_at, self.rows, pair_only)
        else:
            self.for_rows = lambda pairs: Counting(inner.for_rows(pairs), stop_at, self.rows)

    def __call__(self, logits):
        if len(self.rows) == self.stop_at:
            raise Stopped
        self.rows.append(logits.shape[0])
        return self.inner(logits)


def pairs():
    return random_ids(2, T, seed=1), random_ids(2, T, seed=2)


METRIC = rh.metrics.logit_difference(torch.tensor([3, 6]), wrong=4)


def test_pairs_share_batches_where_the_metric_picks_per_row():
    model = build("qwen3_5")
    clean, corrupt = pairs()
    shared, alone = Counting(METRIC), Counting(METRIC, pair_only=True)
    a = rh.patching_sweep(model, clean, corrupt, shared, batch_size=32, progress=False, reuse_prefix=False)
    b = rh.patching_sweep(model, clean, corrupt, alone, batch_size=32, progress=False, reuse_prefix=False)
    cells = 2 * 2 * T  # pairs x layers x positions
    assert shared.rows == [2, 2, 32], f"baselines of both pairs, then the {cells} cells in one batch: {shared.rows}"
    assert alone.rows == [1, 1, 1, 1, 16, 16], f"for_pair only: a pair a forward: {alone.rows}"
    assert_close("shared batches vs a pair a batch", b.values, a.values, rtol=1e-5, atol=1e-6)


def test_a_stopped_sweep_resumes_from_its_checkpoint(tmp_path):
    model = build("mamba2")
    clean, corrupt = pairs()
    whole = rh.patching_sweep(model, clean, corrupt, METRIC, batch_size=4, progress=False)
    path = tmp_path / "sweep.pt"
    stopping = Counting(METRIC, stop_at=2 + 3)  # the baselines, three rounds of one batch, then stopped
    with pytest.raises(Stopped):
        rh.patching_sweep(
            model,
            clean,
            corrupt,
            stopping,
            batch_size=4,
            budget_bytes=0,
            progress=False,
            checkpoint=path,
            reuse_prefix=False,
        )
    saved = torch.load(path, weights_only=True)
    assert int(saved["done"].sum()) == 12 and saved["done"].flatten()[:12].all(), "the first three rounds' cells"
    saved["key"]["what"] = saved["key"].pop("memory")  # as written before the sweep's "what" became "memory"
    torch.save(saved, path)
    resumed = Counting(METRIC)
    result = rh.patching_sweep(
        model, clean, corrupt, resumed, batch_size=4, progress=False, checkpoint=path, reuse_prefix=False
    )
    cells = 2 * len(whole.layers) * T
    assert resumed.rows[2:] == [4] * ((cells - 12) // 4), f"only the cells left run: {resumed.rows[2:]}"
    assert_close("the resumed sweep vs one run", whole.values, result.values, rtol=1e-5, atol=1e-6)
    again = Counting(METRIC)
    assert torch.equal(
        rh.patching_sweep(model, clean, corrupt, again, progress=False, checkpoint=path).values, result.values
    )
    assert again.rows == [2, 2], f"a finished checkpoint runs no cell: {again.rows}"
    with pytest.raises(
        rh.InvalidValue,
        match=r"checkpoint .*sweep.pt holds another sweep's cells \(its positions"
        r" differ\); remove it or pass another checkpoint path",
    ):
        rh.patching_sweep(model, clean, corrupt, METRIC, positions=[1, 2], progress=False, checkpoint=path)
    with pytest.raises(rh.InvalidValue, match=r"holds another sweep's cells \(its prompts differ\)"):
        rh.patching_sweep(model, corrupt, clean, METRIC, progress=False, checkpoint=path)


def test_distributed_and_checkpoint_arguments_say_what_they_need():
    model = build("mamba")
    clean, corrupt = pairs()
    with pytest.raises(
        rh.InvalidValue,
        match=r"distributed=True needs an initialized torch.distributed process"
        r" group \(torchrun, then torch.distributed.init_process_group\(\)\)",
    ):
        rh.patching_sweep(model, clean, corrupt, METRIC, distributed=True, progress=False)
    with pytest.raises(
        rh.InvalidValue,
        match=r"expected distributed=True or distributed=False or distributed=None,"
        r" got distributed='yes'",
    ):
        rh.patching_sweep(model, clean, corrupt, METRIC, distributed="yes", progress=False)
    with pytest.raises(
        rh.InvalidValue,
        match=r"expected checkpoint as a file path \(str or os.PathLike\) or None,"
        r" got int",
    ):
        rh.patching_sweep(model, clean, corrupt, METRIC, checkpoint=3, progress=False)
