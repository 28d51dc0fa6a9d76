"""Print the distributions docs/tutorial.md quotes, over more prompts and seeds than the page runs.

    python scripts/tutorial_numbers.py                      # seeds 1 (the page's), 3 and 8; 32 pairs, 64 prompts
    python scripts/tutorial_numbers.py --seeds 3 --pairs 64 --prompts 256

The tutorial walks through one prompt pair (`task.contrast(1, seed=7)`); its code then repeats each
measurement on many prompts. This script computes the same quantities as the page's blocks (the same
definitions, the same model: the shipped Mamba-2 MQAR toy) for several seeds, to show how much they move
from one sample of prompts to another. For seed s: the sweeps and attribution run on `task.contrast(pairs,
seed=s)`, effective attention on `task.sample(prompts, seed=s)`, the probes train on `task.sample(1024,
seed=s)` and test on `task.sample(512, seed=s + 1)`; seed 1 is the page's. A distribution is printed as
`min / q1 / median / q3 / max` (over pairs, prompts or keys, as said). A seed takes 10-60 s on 2 shared CPU
cores.
"""

import argparse
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import recurrent_hooks as rh  # noqa: E402
from recurrent_hooks.toys import MQAR, load_toy  # noqa: E402

QUANTILES = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0])


def spread(x: torch.Tensor, percent: bool = False) -> str:
    q = x.float().quantile(QUANTILES).tolist()
    return " / ".join(f"{v:.0%}" if percent else f"{v:.2f}" for v in q)


def sweeps(task: MQAR, model, n: int, seed: int, held: torch.Tensor) -> None:
    """Sections 1 and 2: the sweep, its state and window parts, and attribution, over n pairs; and (section 3)
    both split by whether the changed pair's key is one of `held` ([keys] bool), the keys layer 1's state holds."""
    query = int(task.answer_positions[-1])
    clean, corrupt = task.contrast(n, seed=seed)
    clean_ids, corrupt_ids = clean.ids[:, : query + 1], corrupt.ids[:, : query + 1]
    value = task.value_positions[clean.query_pairs[:, -1]]
    metric = rh.metrics.logit_difference(answer=clean.answers[:, -1], wrong=corrupt.answers[:, -1], position=query)
    rows = torch.arange(n)
    sweep = rh.patching_sweep(model, clean_ids, corrupt_ids, metric, progress=False)
    effect = sweep.normalized()  # [pairs, layers, tokens]
    tokens = torch.arange(effect.shape[-1])
    before = tokens[None, :] < value[:, None]  # [pairs, tokens]
    carried = (tokens[None, :] >= value[:, None]) & (tokens[None, :] < query)
    print(f"  sweep, {n} pairs: clean - corrupt margin {spread(sweep.clean - sweep.corrupt)}")
    print(f"    max |effect| before the value, over all pairs: {effect.abs().amax(1)[before].max():.1e}")
    for layer in (0, 1):
        print(f"    layer {layer} at the value: {spread(effect[rows, layer, value])}")
    print(f"    both layers' sum at the value: {spread(effect[rows, :, value].sum(1))}")
    drift = (effect - effect[rows, :, value][..., None]).abs().amax(1).masked_fill(~carried, 0).amax(1)
    print(f"    max |effect(t) - effect(value)| for t from the value to the query: {spread(drift)}")

    later = carried & (tokens[None, :] > value[:, None])  # from the token after the value to the query
    for what in ("state", "window"):
        part = rh.patching_sweep(model, clean_ids, corrupt_ids, metric, memory=what, progress=False).normalized()
        for layer in (0, 1):
            print(
                f"    {what:>6} only, layer {layer}: at the value {spread(part[rows, layer, value])};"
                f" later, max |{what} - 0| {part[:, layer][later].abs().max():.3f},"
                f" max |{what} - memory| {(part - effect)[:, layer][later].abs().max():.3f}"
            )

    estimate = rh.attribute(model, clean_ids, corrupt_ids, metric)
    exact = sweep.values - sweep.corrupt[:, None, None]
    correlation = torch.stack(
        [torch.corrcoef(torch.stack([exact[i].flatten(), estimate.memory[i].flatten()]))[0, 1] for i in range(n)]
    )
    print(f"  attribution vs the sweep, correlation per pair: {spread(correlation)}")
    guess = estimate.normalized()[rows, :, value].sum(1)
    print(f"    attribution's estimate at the value (both layers, normalized): {spread(guess)}")
    agree = (estimate.memory[rows, :, value].argmax(1) == exact[rows, :, value].argmax(1)).float().mean()
    print(f"    the layer with the larger effect at the value is the same for both: {agree:.0%} of pairs")

    shared = held[clean.pair_keys[rows, clean.query_pairs[:, -1]] - task.key_tokens.start]
    print(f"  the {int(shared.sum())} pairs whose changed key layer 1 holds, and the {int((~shared).sum())} others:")
    layer1 = effect[rows, 1, value]
    print(f"    layer 1 at the value: {spread(layer1[shared])}; others {spread(layer1[~shared])}")
    print(f"    attribution's correlation: {spread(correlation[shared])}; others {spread(correlation[~shared])}")


def probes(task: MQAR, model, seed: int) -> torch.Tensor:
    """Section 3: one probe for the answer, and one probe per key for its value, per layer. Returns the keys
    whose value layer 1's probe reads in more than 90% of the test prompts ([keys] bool)."""
    train, test = task.sample(1024, seed=seed), task.sample(512, seed=seed + 1)
    first_query = int(task.answer_positions[0])
    start = task.value_tokens.start

    def states(prompts):
        with rh.watch(model, keep={"states": [first_query]}) as w, torch.no_grad():
            model(prompts.ids[:, : first_query + 1])
        return [mixer.state_after(first_query).flatten(1) for mixer in w.mixers]

    def ridge(x, labels):
        target = torch.nn.functional.one_hot(labels - start, task.num_values).float()
        return x.T @ torch.linalg.solve(x @ x.T + 0.1 * torch.eye(len(x)), target)

    print(f"  probes (train seed {seed}, test seed {seed + 1}), state after the first query token:")
    for layer, (x, x_test) in enumerate(zip(states(train), states(test))):
        mean = x.mean(0)
        x, x_test = x - mean, x_test - mean
        single = ((x_test @ ridge(x, train.answers[:, 0])).argmax(1) == test.answers[:, 0] - start).float().mean()
        per_key, read = [], torch.zeros(len(test), dtype=torch.long)
        for key in task.key_tokens:
            has, has_test = train.pair_keys == key, test.pair_keys == key  # [prompts, pairs]
            weights = ridge(x[has.any(1)], train.pair_values[has])
            guess = (x_test[has_test.any(1)] @ weights).argmax(1) + start
            per_key.append((guess == test.pair_values[has_test]).float().mean())
            asked = test.ids[:, first_query] == key
            read[asked] = (x_test[asked] @ weights).argmax(1) + start
        chosen = (read == test.answers[:, 0]).float().mean()
        per_key = torch.stack(per_key)
        print(
            f"    layer {layer}: one probe for the answer {single:.1%}; per key (16 keys) {spread(per_key, True)};"
            f" the asked key's probe gives the answer {chosen:.1%}"
        )
    held = per_key > 0.9
    print(
        f"    keys layer 1 holds (over 90%): {held.nonzero().flatten().tolist()}, read {per_key[held].min():.0%} or"
        f" more; the others at most {per_key[~held].max():.0%}"
    )
    return held


def attention(task: MQAR, model, n: int, seed: int) -> None:
    """Section 4: layer 1's (and layer 0's) effective-attention row at the last query, over n prompts."""
    query = int(task.answer_positions[-1])
    prompts = task.sample(n, seed=seed)
    value = task.value_positions[prompts.query_pairs[:, -1]]
    with rh.watch(model, keep=("inputs", "outputs")) as w, torch.no_grad():
        model(prompts.ids[:, : query + 1])
    rows = torch.arange(n)
    others = task.value_positions[None, :] != value[:, None]  # [prompts, pairs]: the other pairs' values
    print(f"  effective attention, {n} prompts, the last query's row, mean |weight| over heads:")
    for layer in (1, 0):
        row = rh.effective_attention(w.mixers[layer]).weights[:, :, query].abs().mean(1)
        share = row / row.sum(1, keepdim=True)  # [prompts, tokens], each row sums to 1
        top = share.argmax(1)
        other = share[:, task.value_positions][others].reshape(n, -1).mean(1)
        keys = share[:, 1::2].sum(1)  # keys and queries: the odd tokens
        asked = share[rows, value]
        print(
            f"    layer {layer}: row's maximum on the queried value in {(top == value).float().mean():.0%} of"
            f" prompts, on BOS in {(top == 0).float().mean():.0%}; share at the queried value {spread(asked)};"
            f" at another pair's value (mean of the 7) {spread(other)} (medians"
            f" {asked.median() / other.median():.1f} times apart); largest share {spread(share.amax(1))};"
            f" on key and query tokens {spread(keys)}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 3, 8])
    parser.add_argument("--pairs", type=int, default=32, help="prompt pairs for the sweeps and attribution")
    parser.add_argument("--prompts", type=int, default=64, help="prompts for effective attention")
    args = parser.parse_args()
    task, model = MQAR(), load_toy("mamba2")
    for seed in args.seeds:
        print(f"seed {seed}")
        held = probes(task, model, seed)
        sweeps(task, model, args.pairs, seed, held)
        attention(task, model, args.prompts, seed)


if __name__ == "__main__":
    main()
