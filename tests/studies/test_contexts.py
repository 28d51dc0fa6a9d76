"""`rh.top_contexts`: the streaming top-k is a sort of every value (ties: the lowest index first), whatever the
batch size; each context is its token's own document within `width` positions (never another's), with fn's value at
every context token; the table and the HTML show them; bad input is refused naming what arrived. On a fake dataset
(the reader's interface: `len`, `take`, `docs`, `positions`, `tokens`) and on a real harvest."""

import html
import re

import pytest
import torch
from _models import build, random_ids

import recurrent_hooks as rh
from recurrent_hooks import plots


class Fake:
    """A dataset with the reader's interface: items of documents of given lengths, in a shuffled order (the
    contexts must come from docs/positions, not from the item order)."""

    def __init__(self, lengths, shape=(2, 3), seed=0, tokens=True, values=None):
        generator = torch.Generator().manual_seed(seed)
        docs = torch.cat([torch.full((n,), d) for d, n in enumerate(lengths)])
        positions = torch.cat([torch.arange(n) for n in lengths])
        order = torch.randperm(len(docs), generator=generator)
        self.docs, self.positions = docs[order], positions[order]
        if tokens:
            self.tokens = torch.randint(3, 50, (len(docs),), generator=generator)
        self.values = torch.randn(len(docs), *shape, generator=generator) if values is None else values
        self.taken = []

    def __len__(self):
        return len(self.docs)

    def take(self, indices):
        indices = torch.as_tensor(indices)
        self.taken.append(len(indices))
        return self.values[indices]


def norm(values):
    return values.flatten(1).norm(dim=1)


def brute_force(scores, k, largest):
    """The indices of the top k, by value then lowest index, from a sort of every value."""
    ranked = sorted(range(len(scores)), key=lambda i: (-scores[i] if largest else scores[i], i))
    return ranked[:k]


@pytest.mark.parametrize("batch_size", [1, 7, 64, 4096])
@pytest.mark.parametrize("largest", [True, False])
@pytest.mark.parametrize("k", [1, 5, 200])
def test_the_top_k_is_a_sort_of_every_value(batch_size, largest, k):
    data = Fake([30, 1, 12, 40, 7], seed=batch_size)
    top = rh.top_contexts(data, norm, k=k, width=3, batch_size=batch_size, largest=largest)
    scores = norm(data.values).double().tolist()
    expected = brute_force(scores, k, largest)
    assert top.indices.tolist() == expected
    assert top.values.tolist() == [scores[i] for i in expected]
    assert [c.rank for c in top] == list(range(len(expected))) and len(top) == min(k, len(data))
    for c in top:
        assert (c.doc, c.position, c.token) == (
            int(data.docs[c.index]),
            int(data.positions[c.index]),
            int(data.tokens[c.index]),
        )
    # streaming: no batch read more than batch_size items
    assert max(data.taken) <= batch_size


@pytest.mark.parametrize("batch_size", [1, 3, 100])
def test_ties_go_to_the_lowest_index(batch_size):
    values = torch.tensor([1.0, 5.0, 5.0, 2.0, 5.0, 2.0, 5.0, 0.0, 2.0])[:, None]
    data = Fake([9], values=values)
    top = rh.top_contexts(data, lambda v: v[:, 0], k=5, width=0, batch_size=batch_size)
    assert top.indices.tolist() == [1, 2, 4, 6, 3]
    bottom = rh.top_contexts(data, lambda v: v[:, 0], k=3, width=0, batch_size=batch_size, largest=False)
    assert bottom.indices.tolist() == [7, 0, 3]


@pytest.mark.parametrize("width", [0, 1, 4, 50])
def test_contexts_stay_in_their_document(width):
    lengths = [30, 1, 12, 40, 7, 3]
    data = Fake(lengths, seed=width)
    top = rh.top_contexts(data, norm, k=len(data), width=width, batch_size=16)  # every token: every edge case
    scores = norm(data.values).double()
    index_of = {(int(d), int(p)): i for i, (d, p) in enumerate(zip(data.docs, data.positions))}
    for c in top:
        low, high = max(c.position - width, 0), min(c.position + width, lengths[c.doc] - 1)
        assert c.positions == list(range(low, high + 1)), (c.doc, c.position)
        assert c.indices == [index_of[c.doc, p] for p in c.positions]
        assert all(int(data.docs[i]) == c.doc for i in c.indices)
        assert c.tokens == data.tokens[c.indices].tolist()
        assert c.positions[c.center] == c.position and c.indices[c.center] == c.index
        assert c.values == scores[c.indices].tolist()  # fn at every context token
        assert (c.cut_before, c.cut_after) == (low > 0, high < lengths[c.doc] - 1)


def test_several_features_take_feature():
    data = Fake([10, 10], shape=(4,))
    top = rh.top_contexts(data, lambda v: v * 2, k=3, width=1, feature=2)
    assert top.indices.tolist() == brute_force((data.values[:, 2] * 2).tolist(), 3, True)
    assert top.feature == 2 and "feature 2" in top.table()
    with pytest.raises(rh.InvalidValue, match=r"got \[20, 4\] for batch 0.*pass feature="):
        rh.top_contexts(data, lambda v: v, k=3)
    with pytest.raises(rh.InvalidValue, match="feature=4 is out of range: fn returned 4 features"):
        rh.top_contexts(data, lambda v: v, k=3, feature=4)


def test_a_memory_of_several_parts_reaches_fn_as_a_dict():
    class Parts(Fake):
        def take(self, indices):
            return {"C": super().take(indices), "n": super().take(indices)[:, 0]}

    data = Parts([6, 4])
    top = rh.top_contexts(data, lambda v: v["n"].sum(1) - v["C"].flatten(1).sum(1), k=4, width=1)
    expected = brute_force((data.values[:, 0].sum(1) - data.values.flatten(1).sum(1)).tolist(), 4, True)
    assert top.indices.tolist() == expected


class Decoder:
    def decode(self, ids):  # a byte-level tokenizer's: each token carries its own space
        return "".join({5: " the", 6: " cat", 7: " sat", 8: "\n"}.get(i, f" <{i}>") for i in ids)


class Converter:
    def convert_ids_to_tokens(self, ids):
        return [f"t{i}" for i in ids]


def _sentence():
    """One document, 'the cat sat' in the middle of 9 tokens; the value largest at 'cat'."""
    values = torch.tensor([0.1, 0.2, 0.3, 0.5, 3.0, 0.4, 0.0, -1.0, 0.2])[:, None]
    data = Fake([9], values=values)
    order = torch.argsort(data.positions)  # items are shuffled: put the tokens and values by position
    data.tokens = torch.empty(9, dtype=torch.long)
    data.tokens[order] = torch.tensor([9, 9, 9, 5, 6, 7, 8, 9, 9])
    data.values = torch.empty_like(values)
    data.values[order] = values
    return data


def test_the_table_and_decoded_tokens():
    data = _sentence()
    top = rh.top_contexts(data, lambda v: v[:, 0], k=2, width=1, tokenizer=Decoder())
    best = top[0]
    assert (best.position, best.token, best.strings) == (4, 6, [" the", " cat", " sat"])
    assert best.text() == "...  the[ cat] sat ..."
    lines = str(top).splitlines()
    assert lines[0] == "top 2 contexts (largest, width 1)"
    assert lines[1].split() == ["rank", "value", "doc", "position", "context"]
    assert lines[2].split()[:4] == ["0", "3", "0", "4"] and lines[2].endswith("...  the[ cat] sat ...")
    assert top.table() == str(top)
    # the newline token is shown escaped, on one line
    worst = rh.top_contexts(data, lambda v: v[:, 0], k=1, width=1, tokenizer=Decoder(), largest=False)
    assert worst[0].position == 7 and worst[0].text() == "... \\n[ <9>] <9>"
    ids = rh.top_contexts(data, lambda v: v[:, 0], k=1, width=2, tokenizer=Converter())
    assert ids[0].strings == ["t9", "t5", "t6", "t7", "t8"] and "t5[t6]t7" in ids[0].text()
    plain = rh.top_contexts(data, lambda v: v[:, 0], k=1, width=2)
    assert plain[0].strings is None and plain[0].text() == "... 9 5 [6] 7 8 ..."
    with pytest.raises(rh.InvalidValue, match="tokenizer= an object with decode or convert_ids_to_tokens"):
        rh.top_contexts(data, lambda v: v[:, 0], k=1, tokenizer=object())


def test_the_html_has_a_shaded_span_per_context_token():
    data = _sentence()
    top = rh.top_contexts(data, lambda v: v[:, 0], k=3, width=2, tokenizer=Decoder())
    page = plots.top_contexts_html(top, title="a <title>")
    spans = re.findall(r'<span class="token( top)?" data-value="([^"]+)"[^>]*>([^<]*)</span>', page)
    assert len(spans) == sum(len(c.tokens) for c in top)
    at = 0
    for c in top:
        mine = spans[at : at + len(c.tokens)]
        at += len(c.tokens)
        assert [float(value) for _, value, _ in mine] == c.values
        assert [html.unescape(text) for _, _, text in mine] == [s.replace("\n", "\\n") for s in c.strings]
        assert [bool(top_) for top_, _, _ in mine] == [i == c.center for i in range(len(c.tokens))]
    assert "a &lt;title&gt;" in page and "<title>" not in page
    assert "rgba(220,40,40,1.000)" in page  # the largest value at full strength
    # other values to shade by: one per context token
    ones = [[1.0] * len(c.tokens) for c in top]
    assert page != plots.top_contexts_html(top, values=ones)
    with pytest.raises(rh.InvalidValue, match=r"one per context token \(\[5, 5, 5\] per context\), got \[1, 1, 1\]"):
        plots.top_contexts_html(top, values=[[1.0]] * 3)


def wrong_on_second_batch(wrong):
    """fn: the norm, but `wrong(values)` on its second call."""
    calls = []

    def fn(values):
        calls.append(len(values))
        return wrong(values) if len(calls) == 2 else norm(values)

    return fn


def test_bad_input_is_refused_naming_what_arrived():
    data = Fake([5, 6])
    with pytest.raises(rh.InvalidValue, match="expected k= an integer >= 1, got 0"):
        rh.top_contexts(data, norm, k=0)
    with pytest.raises(rh.InvalidValue, match="expected width= an integer >= 0, got -1"):
        rh.top_contexts(data, norm, width=-1)
    with pytest.raises(rh.InvalidValue, match="expected batch_size= an integer >= 1, got 0"):
        rh.top_contexts(data, norm, batch_size=0)
    with pytest.raises(rh.InvalidValue, match=r"expected fn to return \[4\] .*got \[4, 2\] for batch 1 \(items 4..7\)"):
        rh.top_contexts(data, wrong_on_second_batch(lambda v: v[:, :, 0]), batch_size=4)
    with pytest.raises(rh.InvalidValue, match=r"return \[4\] \(one number per token\), got \[3\] for batch 1"):
        rh.top_contexts(data, wrong_on_second_batch(lambda v: norm(v)[:3]), batch_size=4)
    with pytest.raises(rh.InvalidValue, match="expected fn to return a tensor \\[4\\], got list for batch 0"):
        rh.top_contexts(data, lambda v: [0.0] * len(v), batch_size=4)
    with pytest.raises(rh.InvalidValue, match="fn returned NaN for batch 0"):
        rh.top_contexts(data, lambda v: norm(v) * float("nan"))
    with pytest.raises(rh.Unavailable, match=r"has no token ids \(`data.tokens`"):
        rh.top_contexts(Fake([5], tokens=False), norm)


@pytest.fixture(scope="module")
def harvest(tmp_path_factory):
    """A harvest of the qwen3_5 test model's states: 2 batches, one with a padded row."""
    out = tmp_path_factory.mktemp("contexts")
    ids = random_ids(2, 7)
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, 4:] = 0
    batches = [{"input_ids": ids, "attention_mask": mask}, random_ids(1, 9, seed=1)]
    rh.harvest(build("qwen3_5"), batches, out, keep=("states",), progress=False)
    rows = [ids[0].tolist(), ids[1, :4].tolist(), batches[1][0].tolist()]  # each document's (non-pad) ids
    return out, rows


def test_on_a_harvest(harvest):
    out, rows = harvest
    data = rh.HarvestDataset(out, layer=0)
    if not hasattr(type(data), "tokens"):
        pytest.fail("rh.HarvestDataset has no `tokens` (the per-token ids top_contexts reads): it is not there yet")
    fn = lambda v: v[:, 1].flatten(1).norm(dim=1)  # noqa: E731
    top = rh.top_contexts(data, fn, k=6, width=2, batch_size=5)
    scores = torch.cat([fn(data.take(torch.arange(s, min(s + 5, len(data))))) for s in range(0, len(data), 5)])
    assert top.indices.tolist() == brute_force(scores.double().tolist(), 6, True)
    for c in top:
        low = max(c.position - 2, 0)
        assert c.tokens == rows[c.doc][low : c.position + 3]
        assert c.token == rows[c.doc][c.position]
        assert c.values == pytest.approx(scores[c.indices].double().tolist(), rel=1e-6)


def test_a_word_level_tokenizer_s_words_are_spaced_as_it_decodes_them():
    """A word-level tokenizer joins its words with spaces when it decodes several: each context token is shown with
    the text it adds to the decoded context, its space included (the toys' tokenizer)."""
    from recurrent_hooks.studies.contexts import _decode as decode_each
    from recurrent_hooks.toys import load_toy_tokenizer

    tok = load_toy_tokenizer("gdn")
    ids = tok("<bos> k0 v0 k1")["input_ids"]
    assert decode_each(tok, ids) == ["<bos>", " k0", " v0", " k1"]
    assert "".join(decode_each(tok, ids)) == tok.decode(ids)
