"""`rh.export_saelens`: a harvest's values in SAELens' cached-activations format (a `datasets` dataset saved to disk,
one row per context of `context_size` tokens of one document, a column per hook name, `token_ids`).

The export is read back with `datasets.load_from_disk`, and checked as SAELens' loader checks it (SAELens 6:
`ActivationsStore.load_cached_activation_dataset` and `_load_raw_llm_batch_from_cached`): the hook column is there,
its feature's shape is `(context_size, d_in)`, `set_format(type="torch", columns=[hook, "token_ids"], dtype=...)`
reads a slice of rows as `[rows, context_size, d_in]` and `[rows, context_size]`. SAELens' own loader is not run:
`sae-lens` pulls some fifty packages (transformer-lens, wandb, plotly, statsmodels, nltk, ...) into the test install,
too much for one check; the export was read with it by hand (sae-lens 6.54.12, `ActivationsStore(...,
cached_activations_path=...)`, `get_raw_llm_batch` and `get_filtered_llm_batch`). `datasets` is the `saelens` extra,
in the `test` extra too: without it these tests skip, naming it."""

import sys

import pytest
import torch
from _models import build, random_ids

import recurrent_hooks as rh

datasets = pytest.importorskip(
    "datasets", reason="rh.export_saelens needs `datasets`: pip install -e '.[saelens]' (the test extra has it)"
)

HOOK = "blocks.0.hook_states"


class Fake:
    """A dataset with the reader's interface: documents of given lengths, items in a shuffled order."""

    def __init__(self, lengths, shape=(2, 3), seed=0, parts=False):
        generator = torch.Generator().manual_seed(seed)
        docs = torch.cat([torch.full((n,), d) for d, n in enumerate(lengths)])
        positions = torch.cat([torch.arange(n) for n in lengths])
        order = torch.randperm(len(docs), generator=generator)
        self.docs, self.positions = docs[order], positions[order]
        self.tokens = torch.randint(3, 50, (len(docs),), generator=generator)
        self.values = torch.randn(len(docs), *shape, generator=generator)
        self.parts = parts

    def __len__(self):
        return len(self.docs)

    def take(self, indices):
        values = self.values[torch.as_tensor(indices)]
        return {"C": values, "n": values[:, 0]} if self.parts else values

    def document(self, doc):
        """Doc `doc`'s item indices in position order."""
        mine = torch.nonzero(self.docs == doc).flatten()
        return mine[torch.argsort(self.positions[mine])]


def read_as_saelens(path, context_size, d_in, rows=2):
    """The export read back as SAELens' loader reads it, with its checks: `(activations, token_ids)` of every row,
    `[rows, context_size, d_in]` and `[rows, context_size]`."""
    data = datasets.load_from_disk(str(path))
    assert isinstance(data, datasets.Dataset)
    assert {HOOK, "token_ids"} <= set(data.column_names)
    assert data.features[HOOK].shape == (context_size, d_in)
    assert data.features[HOOK].dtype == "float32"
    assert data.features["token_ids"].feature.dtype == "int32" and data.features["token_ids"].length == context_size
    data.set_format(type="torch", columns=[HOOK, "token_ids"], device="cpu", dtype=torch.float32)
    for start in range(0, len(data) - rows + 1, rows):  # SAELens reads slices of store_batch_size_prompts rows
        batch = data[start : start + rows]
        assert batch[HOOK].shape == (rows, context_size, d_in)
        assert batch["token_ids"].shape == (rows, context_size)
    data.set_format(type="torch")
    every = data[:]
    return every[HOOK], every["token_ids"].long(), every["doc"], every["position"]


@pytest.mark.parametrize("batch_size", [1, 5, 1000])
def test_rows_are_contexts_of_one_document(tmp_path, batch_size):
    lengths = [9, 3, 4, 0, 8, 13]  # contexts of 4: 2 + 0 + 1 + 2 + 3, the rest dropped
    data = Fake([n for n in lengths if n])
    out = rh.export_saelens(data, tmp_path / "cache", hook_name=HOOK, context_size=4, batch_size=batch_size)
    values, tokens, docs, positions = read_as_saelens(tmp_path / "cache", 4, 6)
    assert len(out) == len(values) == 8
    expected = [(doc, start) for doc, n in enumerate(n for n in lengths if n) for start in range(0, n - 3, 4)]
    assert list(zip(docs.tolist(), positions.tolist())) == expected
    for row, (doc, start) in enumerate(expected):
        items = data.document(doc)[start : start + 4]
        assert torch.equal(values[row], data.values[items].reshape(4, 6))
        assert torch.equal(tokens[row], data.tokens[items])


def test_short_documents_padded(tmp_path):
    data = Fake([9, 3])
    rh.export_saelens(data, tmp_path / "cache", hook_name=HOOK, context_size=4, short="pad", pad_token_id=0)
    values, tokens, docs, positions = read_as_saelens(tmp_path / "cache", 4, 6, rows=1)
    assert list(zip(docs.tolist(), positions.tolist())) == [(0, 0), (0, 4), (0, 8), (1, 0)]
    for row, (doc, start, real) in enumerate([(0, 0, 4), (0, 4, 4), (0, 8, 1), (1, 0, 3)]):
        items = data.document(doc)[start : start + real]
        assert torch.equal(values[row, :real], data.values[items].reshape(real, 6))
        assert torch.equal(tokens[row, :real], data.tokens[items])
        assert not values[row, real:].any() and (tokens[row, real:] == 0).all()


def test_one_head_and_a_reduction(tmp_path):
    data = Fake([8, 5], shape=(3, 2, 2))
    rh.export_saelens(data, tmp_path / "head", hook_name=HOOK, context_size=4, head=1, dtype="float32")
    values, _, docs, positions = read_as_saelens(tmp_path / "head", 4, 4)
    items = data.document(1)[:4]
    assert docs.tolist() == [0, 0, 1] and torch.equal(values[2], data.values[items, 1].reshape(4, 4))
    rh.export_saelens(
        data, tmp_path / "norm", hook_name=HOOK, context_size=4, reduce=lambda v: v.flatten(2).norm(dim=2)
    )
    values, *_ = read_as_saelens(tmp_path / "norm", 4, 3)
    assert torch.allclose(values[2], data.values[items].flatten(2).norm(dim=2))
    parts = Fake([4], parts=True)
    rh.export_saelens(parts, tmp_path / "parts", hook_name=HOOK, context_size=4, reduce=lambda v: v["n"])
    values, *_ = read_as_saelens(tmp_path / "parts", 4, 3, rows=1)
    assert torch.equal(values[0], parts.values[parts.document(0), 0])
    with pytest.raises(rh.InvalidValue, match=r"a memory of several parts \(\['C', 'n'\]\): pass reduce="):
        rh.export_saelens(parts, tmp_path / "p2", hook_name=HOOK, context_size=4)


def test_bad_input_is_refused_before_anything_is_written(tmp_path):
    data = Fake([5, 6])
    cases = [
        ({"context_size": 0}, "expected context_size= an integer >= 1, got 0"),
        ({"short": "cut"}, "expected short= 'drop' or 'pad', got 'cut'"),
        ({"short": "pad"}, "short='pad' pads with the token id pad_token_id=: pass one"),
        ({"dtype": "bfloat16"}, r"expected dtype= one of \['float16', 'float32', 'float64'\], got 'bfloat16'"),
        ({"head": 2}, r"head=2 is out of range: the values have 2 heads \(per-token shape \[2, 3\]\)"),
        ({"reduce": lambda v: v.sum((1, 2))}, r"expected reduce to return \[4, d_in\] for 4 tokens, got \[4\]"),
        ({"context_size": 7}, "no context of 7 tokens: 11 tokens, no document has 7"),
        ({"hook_name": "token_ids"}, "expected hook_name= a column name other than token_ids"),
    ]
    for change, message in cases:
        arguments = {"hook_name": HOOK, "context_size": 4, **change}
        with pytest.raises(rh.InvalidValue, match=message):
            rh.export_saelens(data, tmp_path / "out", **arguments)
        assert not (tmp_path / "out").exists(), change
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(rh.InvalidValue, match="expected path= a new or empty directory"):
        rh.export_saelens(data, tmp_path / "full", hook_name=HOOK, context_size=4)
    gap = Fake([6])
    gap.positions = torch.where(gap.positions == 5, 7, gap.positions)
    with pytest.raises(rh.InvalidValue, match="doc 0 has positions 4 then 7: expected each document's tokens"):
        rh.export_saelens(gap, tmp_path / "gap", hook_name=HOOK, context_size=4)
    untokened = Fake([5])
    del untokened.tokens
    with pytest.raises(rh.Unavailable, match=r"has no token ids \(`data.tokens`"):
        rh.export_saelens(untokened, tmp_path / "t", hook_name=HOOK, context_size=4)


def test_a_harvest_exports_its_documents(tmp_path):
    ids = random_ids(2, 9)
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, 5:] = 0  # (a padded row: 5 tokens, one context of 4)
    rh.harvest(build("qwen3_5"), [{"input_ids": ids, "attention_mask": mask}], tmp_path / "h", progress=False)
    data = rh.HarvestDataset(tmp_path / "h", layer=0)
    if not hasattr(type(data), "tokens"):
        pytest.fail("rh.HarvestDataset has no `tokens` (the per-token ids export_saelens writes): not there yet")
    heads = data.shape[0]
    d_in = data.shape[1] * data.shape[2]
    rh.export_saelens(data, tmp_path / "cache", hook_name=HOOK, context_size=4, head=heads - 1, progress=False)
    values, tokens, docs, positions = read_as_saelens(tmp_path / "cache", 4, d_in, rows=3)
    assert list(zip(docs.tolist(), positions.tolist())) == [(0, 0), (0, 4), (1, 0)]
    rows = [ids[0, 0:4], ids[0, 4:8], ids[1, 0:4]]
    assert torch.equal(tokens, torch.stack(rows).cpu())
    for row, (doc, start) in enumerate([(0, 0), (0, 4), (1, 0)]):
        items = torch.nonzero((data.docs == doc) & (data.positions >= start) & (data.positions < start + 4)).flatten()
        assert torch.equal(values[row], data.take(items)[:, heads - 1].reshape(4, d_in).float())


def test_without_datasets_the_error_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # (an import of it raises ImportError)
    with pytest.raises(
        ImportError, match=r"needs the `datasets` package, an optional extra: pip install recurrent_hooks\[saelens\]"
    ):
        rh.export_saelens(Fake([4]), tmp_path / "out", hook_name=HOOK, context_size=4)
    assert not (tmp_path / "out").exists()


def test_a_failed_export_leaves_no_files(tmp_path):
    calls = []

    def fails_late(values):  # (its first call sizes the column; the third is in the middle of the writing)
        calls.append(len(values))
        if len(calls) == 3:
            raise RuntimeError("out of memory")
        return values.flatten(1)

    data = Fake([8, 8, 8])
    for path in (tmp_path / "new", tmp_path / "empty"):
        calls.clear()
        (tmp_path / "empty").mkdir(exist_ok=True)
        with pytest.raises(RuntimeError, match="out of memory"):
            rh.export_saelens(data, path, hook_name=HOOK, context_size=4, reduce=fails_late, batch_size=4)
        assert len(calls) == 3
        assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"] and not any((tmp_path / "empty").iterdir())
    calls.clear()

    def narrows_late(values):
        calls.append(len(values))
        return values.flatten(1)[:, : 6 if len(calls) < 3 else 5]

    with pytest.raises(rh.InvalidValue, match=r"the same width for every token, 6 \(the first token's\), got 5 for"):
        rh.export_saelens(data, tmp_path / "new", hook_name=HOOK, context_size=4, reduce=narrows_late, batch_size=4)
    assert not (tmp_path / "new").exists()
