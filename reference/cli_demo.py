"""`decodespec demo`: the sampling stage on example logits, before and after the
filters, and seeded draws."""

from __future__ import annotations

import argparse

import torch

from decodespec.spec.params import SamplingParams, sampling_tensors
from decodespec.spec.sampling import process_logits, sample
from decodespec.spec.softmax import softmax

from .cli_options import add_sampling_flags, sampling_params

# The sampling parameters the demo takes (their flags are `SamplingParams`' own,
# `add_sampling_flags`) and shows in its first line.
SHOWN = ("temperature", "top_k", "top_p", "min_p", "seed")


def add_command(commands) -> None:  # noqa: ANN001 (argparse's private subparsers type)
    """The `demo` subcommand of `decodespec`."""
    show = commands.add_parser("demo", help="the sampling stage on example logits")
    add_sampling_flags(show, SHOWN, top_p=0.9, seed=0)
    show.add_argument("--draws", type=int, default=12)
    show.set_defaults(run=run)


# A made-up next-token distribution after "The capital of France is": a few
# likely continuations and a long tail, enough to see each filter act.
EXAMPLE_TOKENS = [
    " Paris", " a", " the", " located", " known", " not", " one", " home",
    " famous", " also", " Lyon", " called", " in", " very", " Marseille", " beautiful",
]  # fmt: skip
EXAMPLE_LOGITS = [
    6.9, 6.3, 6.0, 5.2, 4.9, 4.1, 3.8, 3.5, 3.5, 3.3, 2.6, 2.4, 2.2, 1.9, 1.5, 1.1,
]  # fmt: skip


def demo(params: SamplingParams, draws: int) -> str:
    """The example distribution before and after the filters, and seeded draws."""
    vocab = len(EXAMPLE_TOKENS)
    logits = torch.tensor([EXAMPLE_LOGITS])
    tensors = sampling_tensors(
        [params], vocab_size=vocab, prompt_token_ids=[[0]], output_token_ids=[[]]
    )
    raw = softmax(logits)[0]
    filtered = softmax(process_logits(logits, **tensors.process_logits_args))[0]
    lines = [
        " ".join(f"{name}={getattr(params, name)}" for name in SHOWN),
        "",
        f"{'token':<12} {'raw p':>8} {'filtered p':>11}",
    ]
    for i in raw.argsort(descending=True, stable=True).tolist():
        mark = "" if filtered[i] > 0 else "  (removed)"
        lines.append(f"{EXAMPLE_TOKENS[i]!r:<12} {raw[i]:8.4f} {filtered[i]:11.4f}{mark}")
    # One row per step of the same request: every draw uses fresh random numbers.
    batch = {k: v.repeat(draws) for k, v in tensors.items()}
    batch["step"] = torch.arange(draws)
    tokens = sample(logits.repeat(draws, 1), **batch).tolist()
    lines += ["", f"{draws} seeded draws:", "".join(EXAMPLE_TOKENS[t] for t in tokens)]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    print(demo(sampling_params(args), args.draws))
    return 0
