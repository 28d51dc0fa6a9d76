"""recurrent_hooks.toys: the MQAR task, init_for_recall, and the shipped trained toys (loaded from the
package, no network): accuracy on fresh prompts, greedy generate over the cache, watching, patching, and
their packaged tokenizer (prompts round-trip, every id has a word, the files match their builder)."""

import json
import math
import socket

import pytest
import torch
from _compare import assert_close, assert_equal

import recurrent_hooks as rh
from recurrent_hooks import toys
from recurrent_hooks.toys import MQAR, TOYS, generate_answers, load_toy

FRESH = 20240611  # a seed no training run or docstring uses
STATE_SHAPES = {  # per recurrent layer, after [batch, seq]
    "gdn": (4, 16, 16),  # heads key_dim value_dim
    "gdn_recall": (4, 16, 16),
    "mamba2": (8, 16, 16),  # heads head_dim d_state
}
KERNELS = {  # (prompt kernel, decode kernel) of the first recurrent layer
    "gdn": ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"),
    "gdn_recall": ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"),
    "mamba2": ("mamba2_chunk_scan", "mamba2_selective_state_update"),
}


@pytest.fixture(scope="module")
def models():
    return {}


def _toy(models, name):
    if name not in models:
        models[name] = load_toy(name)
    return models[name]


# --- the task -------------------------------------------------------------------------------------


def test_task_is_deterministic_in_its_seed():
    task = MQAR()
    a, b, c = task.sample(32, seed=3), task.sample(32, seed=3), task.sample(32, seed=4)
    assert_equal("same seed", a.ids, b.ids)
    assert not torch.equal(a.ids, c.ids)
    gen_a, gen_b = torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)
    assert_equal("same generator", task.sample(8, generator=gen_a).ids, task.sample(8, generator=gen_b).ids)
    with pytest.raises(TypeError, match="seed"):
        task.sample(4)


def test_task_layout():
    task = MQAR(num_pairs=6, num_queries=4, num_keys=10, num_values=7)
    batch = task.sample(64, seed=0)
    assert batch.ids.shape == (64, task.seq_len) == (64, 1 + 12 + 8)
    assert set(task.key_tokens).isdisjoint(task.value_tokens) and task.vocab_size == task.value_tokens.stop
    assert_equal("bos", torch.ones(64, dtype=torch.long), batch.ids[:, 0])
    assert_equal("keys", batch.pair_keys, batch.ids[:, task.key_positions])
    assert_equal("values", batch.pair_values, batch.ids[:, task.value_positions])
    assert ((batch.pair_keys >= task.key_tokens.start) & (batch.pair_keys < task.key_tokens.stop)).all()
    assert ((batch.pair_values >= task.value_tokens.start) & (batch.pair_values < task.value_tokens.stop)).all()
    assert all(len(set(row.tolist())) == task.num_pairs for row in batch.pair_keys)  # distinct keys
    assert all(len(set(row.tolist())) == task.num_queries for row in batch.query_pairs)  # distinct queries
    assert_equal("queries", batch.pair_keys.gather(1, batch.query_pairs), batch.ids[:, task.query_positions])
    assert_equal("answers", batch.pair_values.gather(1, batch.query_pairs), batch.answers)
    assert_equal("answer tokens", batch.answers, batch.ids[:, task.answer_token_positions])
    assert_equal("answer positions", task.query_positions, task.answer_positions)


@pytest.mark.parametrize("query", [-1, 0, 2])
def test_contrast_changes_one_value_and_one_answer(query):
    task = MQAR()
    clean, corrupt = task.contrast(128, seed=1, query=query)
    q = query % task.num_queries
    pair = clean.query_pairs[:, q]
    expected = torch.zeros_like(clean.ids, dtype=torch.bool)
    rows = torch.arange(128)
    expected[rows, task.value_positions[pair]] = True
    expected[:, task.answer_token_positions[q]] = True
    assert_equal("positions that differ", expected, clean.ids != corrupt.ids)
    assert_equal("same keys and queries", clean.query_pairs, corrupt.query_pairs)
    changed = torch.zeros_like(clean.answers, dtype=torch.bool)
    changed[:, q] = True
    assert_equal("answers that differ", changed, clean.answers != corrupt.answers)
    assert_equal("the corrupt answer is the new value", corrupt.pair_values[rows, pair], corrupt.answers[:, q])
    if query == -1:  # without the final answer token the prompts differ in exactly one token
        assert_equal("one token", torch.ones(128, dtype=torch.long), (clean.ids[:, :-1] != corrupt.ids[:, :-1]).sum(1))


# --- the init -------------------------------------------------------------------------------------


def test_init_for_recall_changes_gated_deltanet_decay_and_conv_only():
    built = toys.build_toy("gdn", seed=0)
    torch.manual_seed(0)
    plain = type(built)(toys.toy_config("gdn"))
    before = {k: v.clone() for k, v in plain.state_dict().items()}
    toys.init_for_recall(plain)
    after = plain.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    (a_log,) = [k for k in before if k.endswith("linear_attn.A_log")]
    (conv,) = [k for k in before if k.endswith("linear_attn.conv1d.weight")]
    assert changed == {a_log, conv}
    assert_close("A / 64", before[a_log] - math.log(64), after[a_log])
    assert_close("conv x 16", before[conv] * 16, after[conv])
    assert_equal("build_toy applies it", after[a_log], built.state_dict()[a_log])
    mamba2 = toys.build_toy("mamba2", seed=0)
    torch.manual_seed(0)
    plain2 = type(mamba2)(toys.toy_config("mamba2"))
    for key, value in plain2.state_dict().items():
        assert_equal(key, value, mamba2.state_dict()[key])


# --- the shipped models ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", TOYS)
def test_toy_loads_offline_and_recalls(name, models, monkeypatch):
    def no_network(*args, **kwargs):
        raise AssertionError("load_toy touched the network")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    assert toys._models.weights_file(name).is_file()
    assert len(toys._models.weights_file(name).read_bytes()) < 1_000_000
    model = _toy(models, name)
    assert not model.training
    task = toys.toy_task(name)
    batch = task.sample(256, seed=FRESH)
    with torch.no_grad():
        accuracy = task.accuracy(model(batch.ids).logits, batch)
    assert accuracy >= 0.95, f"{name}: {accuracy:.4f} of fresh queries answered"


@pytest.mark.parametrize("name", TOYS)
def test_toy_inside_watch_keeps_states(name, models):
    model = _toy(models, name)
    task = toys.toy_task(name)
    batch = task.sample(4, seed=FRESH + 1)
    with torch.no_grad():
        expected = model(batch.ids).logits
        with rh.watch(model, keep=("states",)) as w:
            got = model(batch.ids).logits
    assert_close("logits inside the watch", expected, got, rtol=1e-4, atol=1e-5)
    assert len(w.mixers) >= 1
    for mixer in w.mixers:
        assert mixer.states.shape == (4, task.seq_len, *STATE_SHAPES[name])
        assert_close(
            f"{mixer} state after the last token = the kept last state", mixer.states[:, -1], mixer.state_after(-1)
        )


@pytest.mark.parametrize("name", TOYS)
def test_toy_generates_answers_over_the_cache(name, models):
    """Greedy generate: answer 0 from the prompt, answers 1.. from one-token decode steps over the cache."""
    model, task = _toy(models, name), toys.toy_task(name)
    batch = task.sample(32, seed=FRESH + 2)
    with torch.no_grad():
        forced = task.answer_logits(model(batch.ids).logits).argmax(-1)
        with rh.watch(model) as w:
            generated = generate_answers(model, task, batch)
    prompt_kernel, decode_kernel = KERNELS[name]
    kernels = [call.kernel for call in w.mixers[0].calls]
    assert kernels == [prompt_kernel] + [decode_kernel] * (2 * task.num_queries - 2)
    assert_equal("generated = teacher-forced argmax", forced, generated)
    accuracy = (generated == batch.answers).float().mean().item()
    assert accuracy >= 0.95, f"generated answers right: {accuracy:.4f}"


@pytest.mark.skipif("gdn" not in TOYS, reason="the gdn toy does not ship")
def test_gdn_binding_is_done_by_attention_not_the_state(models):
    """As `load_toy`'s docstring says: writing the corrupt run's gated DeltaNet memory just before the
    last query into the clean run leaves most answers clean and flips few to the corrupt value."""
    model, task = _toy(models, "gdn"), toys.toy_task("gdn")
    clean, corrupt = task.contrast(256, seed=7)
    before = int(task.query_positions[-1]) - 1  # the last token before the last query
    with torch.no_grad(), rh.watch(model, keep=("states", "windows")) as w:
        model(corrupt.ids[:, :-1])
        memory = w.mixer(0).memory_after(before)
    with torch.no_grad(), rh.watch(model) as w:
        w.mixer(0).set_memory_after(before, memory)
        patched = model(clean.ids[:, :-1]).logits[:, -1].argmax(-1)
    flipped = (patched == corrupt.answers[:, -1]).float().mean().item()
    kept = (patched == clean.answers[:, -1]).float().mean().item()
    assert flipped <= 0.1 and kept >= 0.8, f"flipped to corrupt {flipped:.3f}, still clean {kept:.3f}"


@pytest.mark.skipif("mamba2" not in TOYS, reason="the mamba2 toy does not ship")
def test_mamba2_binding_lives_in_the_state(models):
    """Writing the corrupt run's Mamba-2 states just before the last query flips the clean run's answer."""
    model, task = _toy(models, "mamba2"), toys.toy_task("mamba2")
    clean, corrupt = task.contrast(256, seed=7)
    before = int(task.query_positions[-1]) - 1
    with torch.no_grad(), rh.watch(model, keep=("states",)) as w:
        model(corrupt.ids[:, :-1])
        states = [mixer.state_after(before) for mixer in w.mixers]
    with torch.no_grad(), rh.watch(model) as w:
        for mixer, state in zip(w.mixers, states):
            mixer.set_state_after(before, state)
        patched = model(clean.ids[:, :-1]).logits[:, -1].argmax(-1)
    flipped = (patched == corrupt.answers[:, -1]).float().mean().item()
    assert flipped >= 0.95, f"patched answers that became the corrupt value: {flipped:.3f}"


# --- gdn_recall: the attention layer is a no-op, the recall is in the gated DeltaNet memory --------


def _o_projs(model):
    return [layer.self_attn.o_proj for layer in model.model.layers if hasattr(layer, "self_attn")]


def test_gdn_recall_attention_is_a_frozen_zero(models, monkeypatch):
    built = toys.build_toy("gdn_recall", seed=0)
    layers = [layer.block_type for layer in built.model.layers]
    assert layers == ["linear_attention", "linear_attention", "full_attention"]
    for model in (built, _toy(models, "gdn_recall")):
        (o_proj,) = _o_projs(model)
        assert o_proj.bias is None and not o_proj.weight.requires_grad
        assert_equal("o_proj", torch.zeros_like(o_proj.weight), o_proj.weight)
    trained = {n for n, p in built.named_parameters() if p.requires_grad}
    assert trained == {n for n, _ in built.named_parameters()} - {"model.layers.2.self_attn.o_proj.weight"}

    # the attention adds nothing to the residual stream of the shipped model
    model, task = _toy(models, "gdn_recall"), toys.toy_task("gdn_recall")
    outputs = []
    handle = _o_projs(model)[0].register_forward_hook(lambda module, args, out: outputs.append(out))
    try:
        with torch.no_grad():
            model(task.sample(4, seed=FRESH + 3).ids)
    finally:
        handle.remove()
    assert_equal("attention output", torch.zeros_like(outputs[0]), outputs[0])

    # the loader refuses weights whose o_proj is not zero
    from safetensors.torch import load as load_bytes
    from safetensors.torch import save

    state = load_bytes(toys._models.weights_file("gdn_recall").read_bytes())
    key = "model.layers.2.self_attn.o_proj.weight"
    state[key] = torch.full_like(state[key], 1e-3)

    class Tampered:
        def read_bytes(self):
            return save(state)

    monkeypatch.setattr(toys._models, "weights_file", lambda name: Tampered())
    with pytest.raises(RuntimeError, match="o_proj must be all zeros"):
        load_toy("gdn_recall")


def _patched_logits(model, clean, corrupt, token_of_row, layers=None):
    """The corrupt run's logits at its last position (the last query; the prompts end before its answer)
    when the CLEAN run's whole memory (state and conv window) of each gated DeltaNet layer in `layers`
    (default: all) is written after token ``token_of_row[b]``. Rows are grouped by token, since
    `set_memory_after` takes one token."""
    ids_clean, ids_corrupt = clean.ids[:, :-1], corrupt.ids[:, :-1]  # they differ in the changed value only
    with torch.no_grad(), rh.watch(model, keep=("states", "windows")) as clean_watch:
        model(ids_clean, use_cache=False)
    logits = torch.empty(len(clean), model.config.vocab_size)
    for token in token_of_row.unique().tolist():
        rows = (token_of_row == token).nonzero().flatten()
        memory = {
            layer: type(m)(*(x[rows] for x in m))
            for layer, m in clean_watch.memory_after(token).items()
            if layers is None or layer in layers
        }
        with torch.no_grad(), rh.watch(model) as w:
            w.set_memory_after(token, memory)
            logits[rows] = model(ids_corrupt[rows], use_cache=False).logits[:, -1]
    return logits


def test_gdn_recall_binding_is_in_the_recurrent_memory(models):
    """The recall of `gdn_recall` goes through the gated DeltaNet memory (256 `contrast` pairs, seed 7;
    the last query's pair has a different value in the corrupt run). Writing the clean run's memory
    into the corrupt run after the token just before the last query restores the clean answer
    (measured 98.8% = the clean run's own accuracy on that query: with the attention a no-op, the last
    position is a function of its token and the memory, so the patched logits ARE the clean ones);
    writing it after the changed pair's key (before the changed value) restores none (measured 0.0%).
    Layer 0's memory alone restores 98.8%, layer 1's alone 0.0%: layer 0 holds the binding."""
    model, task = _toy(models, "gdn_recall"), toys.toy_task("gdn_recall")
    clean, corrupt = task.contrast(256, seed=7)
    with torch.no_grad():
        unpatched = model(corrupt.ids[:, :-1], use_cache=False).logits[:, -1]
        clean_logits = model(clean.ids[:, :-1], use_cache=False).logits[:, -1]
    assert (unpatched.argmax(-1) == corrupt.answers[:, -1]).float().mean().item() >= 0.9  # the corruption works

    def restored(logits):
        return (logits.argmax(-1) == clean.answers[:, -1]).float().mean().item()

    before_query = torch.full((256,), int(task.query_positions[-1]) - 1)
    late = _patched_logits(model, clean, corrupt, before_query)
    assert restored(late) >= 0.9, f"restored by the memory before the query: {restored(late):.3f}"
    assert_close("patched corrupt run = clean run at the last query", clean_logits, late, rtol=1e-4, atol=1e-4)
    key_of_changed_pair = task.key_positions[clean.query_pairs[:, -1]]
    early = _patched_logits(model, clean, corrupt, key_of_changed_pair)
    assert restored(early) <= 0.05, f"restored by the memory after the changed pair's key: {restored(early):.3f}"
    assert restored(_patched_logits(model, clean, corrupt, before_query, layers={0})) >= 0.9
    assert restored(_patched_logits(model, clean, corrupt, before_query, layers={1})) <= 0.1


# --- the tokenizer --------------------------------------------------------------------------------


def _words(task, ids):
    """The words of `ids` as the tokenizer's vocabulary names them (k{i} = key_tokens[i], v{i} = value_tokens[i])."""
    special = {0: "<pad>", 1: "<bos>", 2: "<eos>", 3: "<unk>"}
    keys, values = task.key_tokens, task.value_tokens
    return [special.get(t) or (f"k{t - keys.start}" if t in keys else f"v{t - values.start}") for t in ids.tolist()]


@pytest.fixture(scope="module")
def tok():
    return toys.load_toy_tokenizer("gdn")


def test_tokenizer_round_trips_prompts(tok):
    task = MQAR()
    clean, corrupt = task.contrast(64, seed=FRESH + 4)
    for batch in (task.sample(64, seed=FRESH + 5), clean, corrupt):
        texts = tok.batch_decode(batch.ids)
        for row, text in zip(batch.ids, texts):
            assert text.split(" ") == _words(task, row)
            assert text.startswith("<bos> k")
            assert tok(text)["input_ids"] == row.tolist()
        encoded = tok(texts, return_tensors="pt")
        assert_equal("batch encode", batch.ids, encoded["input_ids"])
        assert set(encoded) == {"input_ids", "attention_mask"}  # no token_type_ids for the model to refuse
    assert tok("<bos> k3 v7 k3")["input_ids"] == [1, 7, 27, 7]  # as the docstring says
    assert tok("  <bos>\tk3\n v7 ")["input_ids"] == [1, 7, 27]  # any whitespace separates words
    assert tok("<bos> k3 banana v7")["input_ids"] == [1, 7, 3, 27]  # an unknown word is <unk>
    assert tok.decode(clean.ids[0], skip_special_tokens=True) == " ".join(_words(task, clean.ids[0, 1:]))


@pytest.mark.parametrize("name", TOYS)
def test_tokenizer_names_every_id_of_the_model(name, models):
    model, tok = _toy(models, name), toys.load_toy_tokenizer(name)
    size = model.get_input_embeddings().num_embeddings
    assert len(tok) == tok.vocab_size == size == model.config.vocab_size
    words = tok.convert_ids_to_tokens(list(range(size)))
    assert len(set(words)) == size and all(" " not in word for word in words)
    for token, word in enumerate(words):
        assert tok.decode([token]) == word
        assert tok(word)["input_ids"] == [token]
    assert tok.decode(list(range(size))).split(" ") == words
    config = model.config
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (
        config.pad_token_id,
        config.bos_token_id,
        config.eos_token_id,
        3,
    )
    assert (tok.pad_token, tok.bos_token, tok.eos_token, tok.unk_token) == ("<pad>", "<bos>", "<eos>", "<unk>")


@pytest.mark.parametrize("name", TOYS)
def test_tokenizer_output_feeds_the_model(name, models):
    model, tok, task = _toy(models, name), toys.load_toy_tokenizer(name), toys.toy_task(name)
    batch = task.sample(8, seed=FRESH + 6)
    with torch.no_grad():
        expected = model(batch.ids).logits
        got = model(**tok(tok.batch_decode(batch.ids), return_tensors="pt")).logits
    assert_close("logits from the tokenizer's ids", expected, got, rtol=1e-5, atol=1e-6)


def test_tokenizer_names_ids_beyond_the_task_and_refuses_fewer():
    tok = toys.build_toy_tokenizer(MQAR(), vocab_size=40)
    assert tok.convert_ids_to_tokens([35, 36, 39]) == ["v15", "<unused_36>", "<unused_39>"]
    assert tok("<bos> <unused_38> v15")["input_ids"] == [1, 38, 35]
    assert tok.decode([1, 38, 35], skip_special_tokens=True) == "v15"
    small = MQAR(num_pairs=2, num_queries=1, num_keys=3, num_values=2)
    assert toys.toy_vocabulary(small) == {
        "<pad>": 0, "<bos>": 1, "<eos>": 2, "<unk>": 3, "k0": 4, "k1": 5, "k2": 6, "v0": 7, "v1": 8
    }  # fmt: skip
    with pytest.raises(ValueError, match="smaller than the task's vocabulary"):
        toys.build_toy_tokenizer(MQAR(), vocab_size=35)
    with pytest.raises(KeyError, match="unknown toy"):
        toys.load_toy_tokenizer("nope")


def test_shipped_tokenizer_files_are_what_the_builder_writes(tmp_path):
    """The packaged files cannot drift from `write_toy_tokenizer` (regenerate them with
    ``python scripts/train_toys.py --tokenizer-only``)."""
    written = toys.write_toy_tokenizer(tmp_path, MQAR())
    shipped = toys._tokenizer.tokenizer_files()
    assert sorted(p.name for p in written) == sorted(p.name for p in shipped.iterdir())
    for path in written:  # compared as JSON: the content, not the layout of the text
        got, built = json.loads(shipped.joinpath(path.name).read_text(encoding="utf-8")), json.loads(path.read_text())
        assert got == built, (
            f"{path.name} differs from write_toy_tokenizer: run `python scripts/train_toys.py --tokenizer-only`"
        )
    # and transformers reads the folder by itself (AutoTokenizer), to the same tokenizer
    from transformers import AutoTokenizer

    auto, tok = AutoTokenizer.from_pretrained(str(tmp_path)), toys.load_toy_tokenizer("mamba2")
    assert auto.get_vocab() == tok.get_vocab() == toys.toy_vocabulary()
    assert auto.special_tokens_map == tok.special_tokens_map
    text = "<bos> k3 v7 k3 v7"
    assert auto(text)["input_ids"] == tok(text)["input_ids"] == [1, 7, 27, 7, 27]


def test_package_data_covers_the_weights_and_the_tokenizer():
    """pyproject's package-data globs for recurrent_hooks.toys match every file under weights/ (so a
    wheel ships them; load_toy and load_toy_tokenizer read them with importlib.resources)."""
    import ast
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parents[2]
    line = re.search(r'^"recurrent_hooks\.toys" = (\[.*\])$', (root / "pyproject.toml").read_text(), flags=re.M)
    assert line, "pyproject.toml has no package-data entry for recurrent_hooks.toys"
    package = root / "recurrent_hooks" / "toys"
    covered = {path for pattern in ast.literal_eval(line.group(1)) for path in package.glob(pattern)}
    files = {path for path in (package / "weights").rglob("*") if path.is_file()}
    assert {p.name for p in files} >= {f"{name}.safetensors" for name in TOYS} | {"tokenizer.json"}
    assert files <= covered, f"not in the package data: {sorted(str(p) for p in files - covered)}"
