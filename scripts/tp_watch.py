"""Watch a tensor-parallel model: do states, writes and hooks on every rank equal a single-process run?

    torchrun --nproc_per_node=2 scripts/tp_watch.py

On each rank this builds nothing from the Hub: rank 0 writes a tiny random-weight Qwen3_5ForCausalLM
(two gated DeltaNet layers, two attention layers) with `save_pretrained`, then every rank loads it
twice, once as it is (the single-process model, no collective involved) and once with transformers'
tensor parallelism, `from_pretrained(path, tp_plan="auto")` (the `DistributedConfig(tp_plan="auto")`
form; the bare keyword is its deprecated spelling). Inside `recurrent_hooks.watch` it compares, on every
rank: the logits, the kept states and convolution windows, a `set_state_after` write, a hook on every
token during greedy generate, and that nothing stays rebound after the block. Any mismatch raises, and
torchrun exits non-zero.

Backend: nccl on CUDA when there is a GPU per process, gloo on the CPU otherwise. The attention heads
(2 query, 2 key/value) and the gated DeltaNet heads divide by 2, the world size this is written for.
"""

import argparse
import math
import pathlib
import shutil
import sys
import tempfile
import warnings

import torch
import torch.distributed as dist
import transformers
from transformers.distributed import DistributedConfig

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))  # run from a clone without installing

from _process_group import setup  # noqa: E402  (scripts/, the script's own folder, is on sys.path)

import recurrent_hooks as rh  # noqa: E402
import recurrent_hooks.engine.binding.rebinding as patching  # noqa: E402
from recurrent_hooks.demo import _CONFIG  # noqa: E402

ALL = ("states", "windows")
RTOL, ATOL = 1e-5, 1e-6  # float32; tensor parallelism changes the order of the attention's sums
T, NEW = 13, 5


def close(name: str, expected: torch.Tensor, got: torch.Tensor) -> None:
    torch.testing.assert_close(
        got, expected, rtol=RTOL, atol=ATOL, msg=lambda m: f"rank {dist.get_rank()}: {name}: {m}"
    )


def save_model(directory: str | None) -> pathlib.Path:
    """Rank 0 writes the tiny model; every rank gets the same path."""
    box = [None]
    if dist.get_rank() == 0:
        root = pathlib.Path(directory or tempfile.mkdtemp(prefix="tp_watch_"))
        torch.manual_seed(0)
        config = transformers.Qwen3_5TextConfig(**{**_CONFIG, "num_key_value_heads": 2})  # heads divide by 2
        model = transformers.Qwen3_5ForCausalLM(config)
        with torch.no_grad():  # the demo's slower decay (recurrent_hooks/demo.py): a memory of tens of tokens
            for layer in model.model.layers:
                if hasattr(layer, "linear_attn"):
                    layer.linear_attn.A_log -= math.log(64)
        model.save_pretrained(root / "model")
        box = [str(root / "model")]
    dist.broadcast_object_list(box, src=0)
    return pathlib.Path(box[0])


def watched_run(model, ids, value):
    """Kept states of a forward; a forward with a write; generate with a hook on every token."""
    with rh.watch(model, keep=ALL) as read, torch.no_grad():
        logits = model(ids).logits
    with rh.watch(model, keep=ALL) as written, torch.no_grad():
        written.mixers[-1].set_state_after(4, value)
        written_logits = model(ids, use_cache=True).logits
    seen = []

    def damp(mixer, call, token, state):
        seen.append((call, token, state.clone()))
        return state * 0.8

    with rh.watch(model, keep=ALL) as hooked, torch.no_grad():
        hooked.mixers[0].register_state_hook(damp)
        tokens = model.generate(ids, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    with rh.watch(model, keep=ALL) as generated, torch.no_grad():
        greedy = model.generate(ids, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    return dict(
        read=read,
        logits=logits,
        written=written,
        written_logits=written_logits,
        seen=seen,
        hooked=hooked,
        tokens=tokens,
        generated=generated,
        greedy=greedy,
    )


def no_binding_left() -> None:
    assert not patching._BINDINGS, (
        f"rank {dist.get_rank()}: bindings left after the watch: {sorted(patching._BINDINGS)}"
    )
    family = rh.FAMILIES["qwen3_5"]
    for kernel in family.kind.KERNELS:
        bound = getattr(family.module(), kernel.name)
        assert bound is patching.import_default(family.module(), kernel.name), f"{kernel.name} left rebound"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", help="where rank 0 writes the model (default: a new temporary directory)")
    args = parser.parse_args()
    device = setup()
    rank, world = dist.get_rank(), dist.get_world_size()
    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", message=".*falling back to its reference PyTorch implementation.*")
    path = save_model(args.dir)

    single = transformers.Qwen3_5ForCausalLM.from_pretrained(path).to(device).eval()
    parallel = transformers.Qwen3_5ForCausalLM.from_pretrained(
        path, distributed_config=DistributedConfig(tp_plan="auto")
    ).eval()
    sharded = [n for n, p in parallel.named_parameters() if isinstance(p.data, torch.distributed.tensor.DTensor)]
    assert sharded, f"rank {rank}: no parameter is a DTensor: the model was not parallelised"
    assert any(".linear_attn." in n for n in sharded), f"rank {rank}: no gated DeltaNet weight is sharded: {sharded}"

    ids = torch.randint(3, 128, (2, T), generator=torch.Generator().manual_seed(0)).to(device)
    with rh.watch(single, keep=ALL) as w, torch.no_grad():
        single(ids)
    value = w.mixers[-1].state_after(4) * 3 + 0.1

    with torch.no_grad():
        close("logits, unwatched", single(ids).logits, parallel(ids).logits)
    expected, got = watched_run(single, ids, value), watched_run(parallel, ids, value)
    no_binding_left()

    close("logits, states kept", expected["logits"], got["logits"])
    for a, b in zip(expected["read"].mixers, got["read"].mixers, strict=True):
        assert type(b.states) is torch.Tensor, f"rank {rank}: {b} kept a {type(b.states).__name__}"  # not a DTensor
        close(f"{b} states", a.states, b.states)
        close(f"{b} conv windows", a.windows, b.windows)
    close("logits after a write", expected["written_logits"], got["written_logits"])
    for a, b in zip(expected["written"].mixers, got["written"].mixers, strict=True):
        close(f"{b} states after a write", a.states, b.states)
    assert [s[:2] for s in expected["seen"]] == [s[:2] for s in got["seen"]], f"rank {rank}: hook calls differ"
    close("hook inputs", torch.stack([s[2] for s in expected["seen"]]), torch.stack([s[2] for s in got["seen"]]))
    assert torch.equal(expected["tokens"], got["tokens"]), f"rank {rank}: generate with a hook differs"
    assert torch.equal(expected["greedy"], got["greedy"]), f"rank {rank}: greedy generate differs"
    for a, b in zip(expected["generated"].mixers, got["generated"].mixers, strict=True):
        for call in range(NEW):
            close(f"{b} call {call} states", a.calls[call].states, b.calls[call].states)

    dist.barrier()
    if rank == 0 and args.dir is None:
        shutil.rmtree(path.parent)  # the temporary directory save_model made
    print(
        f"rank {rank}/{world} ({device}, {dist.get_backend()}): {len(sharded)} sharded parameters;"
        f" states, windows, a write, a hook and greedy generate equal the single-process run"
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
