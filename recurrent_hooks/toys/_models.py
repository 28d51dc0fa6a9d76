"""Trained MQAR toys of real transformers classes, with their weights in the package (no download).

    from recurrent_hooks.toys import MQAR, load_toy, load_toy_tokenizer
    model = load_toy("gdn")                  # Qwen3_5ForCausalLM, trained on MQAR(), eval mode, float32
    model = load_toy("gdn_recall")           # the same kind, but its recall is in the recurrent state
    batch = MQAR().sample(256, seed=123)
    MQAR().accuracy(model(batch.ids).logits, batch)
    load_toy_tokenizer("gdn").decode(batch.ids[0])   # "<bos> k.. v.. ...": the prompt in words (_tokenizer.py)

`TOYS` lists the names; `toy_config(name)` builds a config, `build_toy(name, seed)` a freshly
initialised (untrained, `init_for_recall`; for ``"gdn_recall"`` with the attention's o_proj zero
and frozen) model, which is what `scripts/train_toys.py` trains.
The weights are stored as float32 safetensors files in ``recurrent_hooks/toys/weights/`` and read
with importlib.resources, so they ship in the wheel.

Layouts:

- ``"gdn"``: `Qwen3_5ForCausalLM`, 2 layers ``[linear_attention, full_attention]``, hidden 64, gated
  DeltaNet with 2 key heads x 16 and 4 value heads x 16 (state [4, 16, 16]), attention 2 heads x 32.
  Why an attention layer at all: transformers 5.24 cannot `generate` with a cache when every qwen3_5
  layer is linear attention (the cache's ``get_seq_length`` raises "can only be called on Attention
  layers"), and the toy must generate. Why this order: with the attention layer FIRST
  (``[full_attention, linear_attention]``, where attention cannot do the lookup and the gated DeltaNet
  would have to carry the binding) the model did not learn in the budget. Tries, all with
  `init_for_recall`'s slow decay or slower, answer accuracy on held-out prompts when stopped
  (18% is what the last pair alone gives): lr 1e-2, 900 steps, 18%; A / 1024, 1,200 steps, 22%;
  key_dim 32, 1,950 steps, 26%; conv x 16, 1,600 steps, 22%; two gated DeltaNet layers after the
  attention, 800 steps, 20%. With the gated DeltaNet first it reached 95% at step 600 and 100% at 3,000.
  What each layer does in the shipped weights: the **attention layer does the lookup**.
  The only other route from a value to its query is the gated DeltaNet's state, and writing the corrupt run's
  layer-0 memory (state and conv window, `set_memory_after`) just before the last query into the clean run turns
  4.3% of the answers into the corrupt value and leaves 86% clean (256 `contrast` pairs): the recurrent state
  does not carry the binding in this toy. Use it to study reading, writing and generation through a
  trained gated DeltaNet, not as a model whose recall lives in its state (that is ``"gdn_recall"``).
- ``"gdn_recall"``: `Qwen3_5ForCausalLM`, 3 layers ``[linear_attention, linear_attention,
  full_attention]``, hidden 64, both gated DeltaNets as in ``"gdn"`` (state [4, 16, 16] each),
  attention 1 head x 16 whose **output projection is zero**: the toy whose recall is in the
  recurrent state, for patching sweeps of the gated DeltaNet memory.
  Why the attention layer exists at all: only so that transformers can `generate` with a cache
  (5.24 builds the causal mask with ``cache.get_seq_length``, which raises "can only be called on
  Attention layers" when every qwen3_5 layer is linear attention). Why it is a no-op:
  ``self_attn.o_proj.weight`` is all zeros (no bias), so the attention block adds exactly 0 to the
  residual stream: the layer is the identity there followed by its MLP, which stays and is trained.
  `build_toy` zeroes o_proj and freezes it (``requires_grad=False``; AdamW never sees it, so weight
  decay cannot move it either), `scripts/train_toys.py` checks it is still zero after training, and
  `load_toy` refuses weights whose o_proj is not all zeros. With the attention out of the picture,
  the only route from a pair's value to the query that asks for it is the gated DeltaNets' memory
  (state and conv window): every later position sees earlier tokens through it alone, so the key-value
  binding must be in the recurrent state. (The layers whose q/k/v projections feed the zero o_proj
  get no gradient and stay at their init; they cost a few thousand parameters.)
  What the memory does in the shipped weights (256 `contrast` pairs, the last query's value
  changed): writing the clean run's whole gated DeltaNet memory (both layers, state and conv window,
  `Watch.set_memory_after`) after the token just before the last query into the corrupt run turns
  98.8% of the corrupt answers back into the clean answer (the clean run's own accuracy on that
  query: the patched logits are the clean ones, since that position sees the past only through the
  memory); written after the changed pair's key, before its value, it restores 0.0%. Layer 0's
  memory alone restores 98.8% (its state alone too), layer 1's alone 0.0%: layer 0's state holds the
  binding (its short conv puts the key next to the value, so one delta-rule layer can store the pair).
  It reached 95% of held-out queries at step ~400 and 99.3% at 1,000 (`scripts/train_toys.py`).
- ``"mamba2"``: `Mamba2ForCausalLM`, 2 Mamba-2 layers, hidden 64, 8 heads x 16, d_state 16, one group
  (state [8, 16, 16]); transformers' own init (`init_for_recall` leaves Mamba-2 alone). No attention,
  so the recall is done by the state space layers, and patching shows where: writing the corrupt
  run's memory just before the last query into the clean run (256 `contrast` pairs) turns 100% of
  the answers into the corrupt value when both layers are written, 85% for layer 0 alone, 11% for
  layer 1 alone (the state alone, without the conv window, gives the same numbers).

Not shipped: Mamba-1 (`MambaForCausalLM`: a training step of the same size took 1.2 s here against
0.12-0.25 s for the others, so a run would not fit the budget) and Kimi delta attention.

Weights: float32 safetensors, the tied ``lm_head.weight`` stored once (as the input embedding).
See `scripts/train_toys.py` for the runs that produced them (seed, steps, time, accuracy).
"""

from __future__ import annotations

import importlib.resources
from typing import Callable

import torch
import transformers

from ._init import SLOW_DECAY_FACTOR, init_for_recall
from ._task import BOS, EOS, MQAR, PAD

__all__ = ["TOYS", "toy_config", "build_toy", "load_toy", "toy_task"]

_TASK = MQAR()  # every toy is trained on the default task
_VOCAB = _TASK.vocab_size
_IDS = dict(pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS)


# what the two gated DeltaNet toys share: the layer sizes (state [4, 16, 16]) and the tied embeddings
_GDN = dict(
    vocab_size=_VOCAB,
    hidden_size=64,
    intermediate_size=128,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    tie_word_embeddings=True,
    **_IDS,
)


def _gdn_config() -> transformers.PretrainedConfig:
    return transformers.Qwen3_5TextConfig(
        **_GDN,
        num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"],
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
    )


def _gdn_recall_config() -> transformers.PretrainedConfig:
    return transformers.Qwen3_5TextConfig(
        **_GDN,
        num_hidden_layers=3,
        layer_types=["linear_attention", "linear_attention", "full_attention"],
        num_attention_heads=1,  # the attention is a no-op (o_proj = 0): as small as it can be
        num_key_value_heads=1,
        head_dim=16,
    )


def _mamba2_config() -> transformers.PretrainedConfig:
    return transformers.Mamba2Config(
        vocab_size=_VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        expand=2,
        num_heads=8,
        head_dim=16,
        state_size=16,
        n_groups=1,
        conv_kernel=4,
        chunk_size=16,
        tie_word_embeddings=True,
        **_IDS,
    )


def _mamba_config() -> transformers.PretrainedConfig:
    return transformers.MambaConfig(
        vocab_size=_VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        expand=2,
        state_size=16,
        conv_kernel=4,
        tie_word_embeddings=True,
        **_IDS,
    )


_CONFIGS: dict[str, tuple[Callable[[], transformers.PretrainedConfig], type]] = {
    "gdn": (_gdn_config, transformers.Qwen3_5ForCausalLM),
    "mamba2": (_mamba2_config, transformers.Mamba2ForCausalLM),
    "gdn_recall": (_gdn_recall_config, transformers.Qwen3_5ForCausalLM),
}
# Toys whose attention layers are the identity on the residual stream: o_proj is zero, frozen in
# training (requires_grad False) and checked on load (see the module docstring, "gdn_recall").
NOOP_ATTENTION: frozenset[str] = frozenset({"gdn_recall"})
_UNSHIPPED = {  # configs kept for scripts/train_toys.py
    "mamba": (_mamba_config, transformers.MambaForCausalLM),
}
TOYS: tuple[str, ...] = tuple(_CONFIGS)


def _check(name: str, shipped: bool = True) -> None:
    if name not in _CONFIGS and (shipped or name not in _UNSHIPPED):
        raise KeyError(f"unknown toy {name!r}; known: {list(TOYS)}")


def toy_task(name: str) -> MQAR:
    """The task toy `name` was trained on (`MQAR()` for every toy)."""
    _check(name)
    return _TASK


def toy_config(name: str) -> transformers.PretrainedConfig:
    """The config of toy `name` (a fresh object each call; also for the configs that do not ship)."""
    _check(name, shipped=False)
    return {**_CONFIGS, **_UNSHIPPED}[name][0]()


def build_toy(name: str, seed: int = 0, *, decay_factor: float = SLOW_DECAY_FACTOR) -> transformers.PreTrainedModel:
    """Toy `name` untrained: seeded transformers init, then `init_for_recall(model, decay_factor)`;
    float32, train mode. Also builds the configs that do not ship (``"mamba"``)."""
    _check(name, shipped=False)
    config_fn, model_cls = {**_CONFIGS, **_UNSHIPPED}[name]
    torch.manual_seed(seed)
    model = init_for_recall(model_cls(config_fn()), decay_factor).float().train()
    if name in NOOP_ATTENTION:
        for o_proj in _attention_outputs(model):
            with torch.no_grad():
                o_proj.weight.zero_()
            o_proj.weight.requires_grad_(False)
    return model


def _attention_outputs(model: torch.nn.Module) -> list[torch.nn.Linear]:
    """The output projections (``self_attn.o_proj``) of the model's softmax attention layers."""
    found = [layer.self_attn.o_proj for layer in model.model.layers if hasattr(layer, "self_attn")]
    if not found:
        raise RuntimeError("no attention layer found")
    for o_proj in found:
        if o_proj.bias is not None:
            raise RuntimeError("a no-op attention needs o_proj without bias")
    return found


def weights_file(name: str):
    """The packaged safetensors file of toy `name` (an importlib.resources Traversable)."""
    _check(name)
    return importlib.resources.files(__package__).joinpath("weights", f"{name}.safetensors")


def load_toy(name: str) -> transformers.PreTrainedModel:
    """Toy `name`, trained on `MQAR()`, loaded from the package: float32, eval mode, no network.

    Builds the model from `toy_config(name)` and loads the packaged weights; the only key the file
    lacks is the tied ``lm_head.weight``, which `tie_weights` fills in. For a toy with a no-op
    attention (``"gdn_recall"``) it checks that every ``self_attn.o_proj.weight`` is all zeros (raises
    RuntimeError otherwise) and leaves it frozen (``requires_grad=False``). Its tokenizer (the words of
    the token ids, shared by every toy) is `load_toy_tokenizer(name)`.
    """
    from safetensors.torch import load as load_bytes

    _check(name)
    config_fn, model_cls = _CONFIGS[name]
    state = load_bytes(weights_file(name).read_bytes())
    model = model_cls(config_fn())
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"}
    if unexpected or set(missing) - tied:
        raise RuntimeError(f"toy {name!r}: weights do not fit the config: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    if name in NOOP_ATTENTION:
        for o_proj in _attention_outputs(model):
            if torch.count_nonzero(o_proj.weight):
                raise RuntimeError(f"toy {name!r}: the attention's o_proj must be all zeros (a no-op attention)")
            o_proj.weight.requires_grad_(False)
    return model.float().eval()
