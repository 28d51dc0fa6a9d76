"""Draw the figures of docs/tutorial.md (and the README) from the shipped Mamba-2 MQAR toy.

    python scripts/tutorial_figures.py          # writes docs/figures/{sweep,attention,state_norms}.png

Needs the plots extra (`pip install -e ".[plots]"`). The computations are those of the tutorial's code.
"""

import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import recurrent_hooks as rh  # noqa: E402
from recurrent_hooks import plots  # noqa: E402
from recurrent_hooks.toys import MQAR, generate_answers, load_toy  # noqa: E402

OUT = pathlib.Path(__file__).resolve().parents[1] / "docs" / "figures"


def token_names(task: MQAR, ids: torch.Tensor) -> list[str]:
    names = {0: "pad", 1: "bos", 2: "eos"}
    names |= {t: f"k{t - task.key_tokens.start}" for t in task.key_tokens}
    names |= {t: f"v{t - task.value_tokens.start}" for t in task.value_tokens}
    return [names.get(int(t), str(int(t))) for t in ids]


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    task, model = MQAR(), load_toy("mamba2")
    clean, corrupt = task.contrast(1, seed=7)
    query = int(task.answer_positions[-1])
    pair = int(clean.query_pairs[0, -1])
    right, wrong = int(clean.answers[0, -1]), int(corrupt.answers[0, -1])
    clean_ids, corrupt_ids = clean.ids[:, : query + 1], corrupt.ids[:, : query + 1]

    def metric(logits: torch.Tensor) -> torch.Tensor:
        return logits[:, query, right] - logits[:, query, wrong]

    labels = token_names(task, corrupt_ids[0])
    sweep = rh.patching_sweep(model, clean_ids, corrupt_ids, metric, progress=False)
    title = f"patching the clean memory into the corrupt run (pair {pair}'s value changed)"
    plots.sweep_heatmap(sweep, labels, normalized=True, title=title).savefig(OUT / "sweep.png", dpi=120)

    with rh.watch(model, keep=("inputs", "outputs")) as w, torch.no_grad():
        model(clean_ids)
    weights = rh.effective_attention(w.mixers[1]).weights[0].abs().mean(0)  # [token, source], mean over heads
    plots.attention_map(
        weights,
        token_names(task, clean_ids[0]),
        title="layer 1: exact effective attention, |A[t, s]| averaged over heads",
    ).savefig(OUT / "attention.png", dpi=120)

    with rh.watch(model, keep=("states",)) as w, torch.no_grad():
        generate_answers(model, task, clean)
    plots.state_norms(w, title="state norm after every token: the prompt, then the decode steps").savefig(
        OUT / "state_norms.png", dpi=120
    )
    print("wrote", ", ".join(str(p.relative_to(OUT.parents[1])) for p in sorted(OUT.glob("*.png"))))


if __name__ == "__main__":
    main()
