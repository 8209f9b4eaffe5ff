"""`decodespec generate PROMPT...`: stream a completion (or print it as JSON), with
its statistics line; optionally constrained by a grammar, speculated, or shown
step by step with each step's candidates (`--show-probs`), or with the first
step's alone on stderr (`--first-probs`, which `make run` passes: where a small
model's greedy answer takes its turn, e.g. a near tie of two first tokens)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from decodespec.spec.generate import TokenLogprobs
from decodespec.spec.params import MAX_TOP_LOGPROBS, SamplingParams

from .backend import BACKENDS, DEFAULT_BACKEND, get_backend
from .cli_options import (
    add_batch_invariant_flag,
    add_budget_flags,
    add_grammar_backend_flag,
    add_sampling_flags,
    add_weights_flag,
    budget_options,
    load_model_with_progress,
    prompt_ids,
    sampling_params,
    speculation,
    torch_device,
)
from .engine import Engine
from .grammar import StructuredOutput
from .request import RequestOutput
from .request_options import RequestOptions
from .tokenizer import Tokenizer


def add_command(commands) -> None:  # noqa: ANN001 (argparse's private subparsers type)
    """The `generate` subcommand of `decodespec`."""
    gen = commands.add_parser("generate", help="generate text from a prompt, streamed")
    gen.add_argument(
        "prompt",
        nargs="+",
        help="one or more prompts, answered one after another by one engine (a later one "
        "reuses the cache blocks of the prefix it shares with an earlier one)",
    )
    gen.add_argument("--system", metavar="TEXT", help="a system message before each prompt")
    gen.add_argument("--model", help="GGUF file or Hugging Face directory (default: bundled)")
    add_sampling_flags(gen, temperature=0.0, max_tokens=256)  # greedy by default
    gen.add_argument(
        "--backend",
        choices=BACKENDS,
        default=DEFAULT_BACKEND,
        help=f"stage functions: the spec's PyTorch (spec, the definition), the same with "
        f"attention batched across requests and a native decode step (torch), or the "
        f"Triton kernels (default {DEFAULT_BACKEND})",
    )
    gen.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="where the model runs (auto: the GPU if there is one)",
    )
    add_weights_flag(gen)
    gen.add_argument("--naive", action="store_true", help="no KV cache: recompute every step")
    gen.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="do not reuse the cache blocks of a prefix an earlier prompt computed",
    )
    gen.add_argument(
        "--speculate",
        metavar="DRAFTER",
        help="speculative decoding with a drafter: ngram (prompt lookup), layers:N (the "
        "model's first N layers) or model:PATH (a smaller model, same vocabulary)",
    )
    gen.add_argument(
        "--num-draft", type=int, default=4, metavar="K", help="draft tokens per step (default 4)"
    )
    constraint = gen.add_argument_group(
        "structured output", "constrain every token to a grammar (at most one of these)"
    ).add_mutually_exclusive_group()
    constraint.add_argument(
        "--json-schema", metavar="FILE|JSON", help="JSON that fits this JSON Schema"
    )
    constraint.add_argument("--json-object", action="store_true", help="any JSON object")
    constraint.add_argument("--regex", metavar="REGEX", help="text this regular expression matches")
    constraint.add_argument(
        "--grammar", metavar="FILE", help="text of this EBNF grammar (llama.cpp's GBNF, rule root)"
    )
    constraint.add_argument(
        "--choice", action="append", metavar="TEXT", help="one of these strings (repeatable)"
    )
    add_grammar_backend_flag(gen)
    add_budget_flags(gen)
    add_batch_invariant_flag(gen)
    gen.add_argument("--raw", action="store_true", help="send the prompt without chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON object at the end")
    gen.add_argument(
        "--show-probs", type=int, default=0, metavar="N", help="show the top N candidates per step"
    )
    gen.add_argument(
        "--first-probs",
        type=int,
        default=0,
        metavar="N",
        help="show the first token's top N candidates on stderr, before the answer (where a "
        "greedy answer takes its turn; only the first step pays for them)",
    )
    gen.set_defaults(run=generate)


def logprobs_json(lp: TokenLogprobs, constrained: bool) -> dict:
    """A token's logprobs; under a grammar each alternative says whether it was allowed."""
    top = [{"token_id": t, "logprob": p} for t, p in lp.top]
    if constrained:
        for alternative in top:
            alternative["allowed"] = alternative["token_id"] not in lp.removed
    return {"token_id": lp.token_id, "logprob": lp.logprob, "rank": lp.rank, "top": top}


def output_json(
    out: RequestOutput, show_logprobs: bool, speculating: bool, constrained: bool = False
) -> dict:
    result = {
        "text": out.text,
        "token_ids": out.token_ids,
        "finish_reason": out.finish_reason,
        "seed": out.seed,
        "prompt_tokens": out.prompt_tokens,
        "cached_tokens": out.cached_tokens,
        "completion_tokens": out.completion_tokens,
        "ttft_s": out.ttft_s,
        "tokens_per_s": out.tokens_per_s,
        "path": out.path,
    }
    if speculating:
        result["draft_tokens"] = out.draft_tokens
        result["accepted_tokens"] = out.accepted_tokens
        result["acceptance_rate"] = out.acceptance_rate
        result["tokens_per_target_pass"] = out.tokens_per_target_pass
    if out.error:
        result["error"] = out.error
    if show_logprobs and out.logprobs is not None:
        result["logprobs"] = [logprobs_json(lp, constrained) for lp in out.logprobs]
    return result


def show_step(tokenizer: Tokenizer, token: int, candidates: list[tuple[int, float]]) -> str:
    """One line of the token probability viewer: the candidates, the chosen one marked."""
    cells = []
    for token_id, prob in candidates:
        mark = "▶" if token_id == token else " "
        cells.append(
            f"{mark}{tokenizer.decode([token_id], skip_special_tokens=False)!r} {prob:6.1%}"
        )
    if token not in [t for t, _ in candidates]:
        cells.append(f"▶{tokenizer.decode([token], skip_special_tokens=False)!r}")
    return "  ".join(cells)


def structured_output(args: argparse.Namespace) -> StructuredOutput | None:
    """The structured-output flag given, its file read and its JSON parsed (what can be
    checked without the model; the engine compiles it against the vocabulary)."""
    if args.json_object:
        return StructuredOutput("json_object", field="--json-object")
    if args.regex is not None:
        return StructuredOutput("regex", source=args.regex, field="--regex")
    if args.choice:
        return StructuredOutput("choice", choices=tuple(args.choice), field="--choice")
    if args.grammar is not None:
        return StructuredOutput(
            "grammar", source=read_file(args.grammar, "--grammar"), field="--grammar"
        )
    if args.json_schema is None:
        return None
    text = args.json_schema
    if not text.lstrip().startswith("{"):  # a file's name, not the schema itself
        text = read_file(text, "--json-schema")
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"--json-schema: not JSON: {error}") from None
    if not isinstance(schema, dict):
        raise ValueError("--json-schema: a JSON Schema is a JSON object")
    return StructuredOutput.json_schema(schema, field="--json-schema")


def read_file(path: str, flag: str) -> str:
    try:
        return Path(path).read_text()
    except OSError as error:
        raise ValueError(f"{flag} {path}: {error.strerror or error}") from None


def generate(args: argparse.Namespace) -> int:
    # Everything that can be checked without the model fails before it loads.
    params = sampling_params(args)
    constraint = structured_output(args)
    if args.raw and args.system is not None:
        raise ValueError("--system needs the chat template: it cannot be used with --raw")
    speculate, draft_path = speculation(args.speculate)
    if args.num_draft < 1:
        raise ValueError(f"--num-draft must be >= 1, got {args.num_draft}")
    device = torch_device(args.device)
    backend = get_backend(args.backend)
    for flag, n in (("--show-probs", args.show_probs), ("--first-probs", args.first_probs)):
        if not 0 <= n <= MAX_TOP_LOGPROBS:
            raise ValueError(f"{flag} must be in [0, {MAX_TOP_LOGPROBS}], got {n}")
    budget = budget_options(args)  # bad flags refused before the model loads
    if backend.kernel_ops and device.type == "cpu":
        print("no GPU: the Triton kernels run in the Triton interpreter (slow)", file=sys.stderr)
    weights, tokenizer = load_model_with_progress(args.model, args.weights)
    weights = weights.to(device)
    draft_model = (
        load_model_with_progress(draft_path, args.weights)[0] if draft_path is not None else None
    )
    engine = Engine(
        weights,
        tokenizer,
        backend=args.backend,
        naive=args.naive,
        prefix_caching=not args.no_prefix_caching,
        show_probs=args.show_probs,
        speculate=speculate,
        num_draft=args.num_draft,
        draft_model=draft_model,
        grammar_backend=args.grammar_backend,
        batch_invariant=args.batch_invariant,
        **budget,
    )
    del weights  # the engine holds the backend's copy (weight_formats)
    print(f"path: {engine.path}", file=sys.stderr)
    failed = False
    for prompt in args.prompt:  # one engine: a later prompt reuses the earlier ones' prefix
        ids = prompt_ids(tokenizer, prompt, args.raw, args.system)
        out = answer(engine, tokenizer, ids, params, constraint, args, speculate is not None)
        failed = failed or out.error is not None
    return 1 if failed else 0


def answer(
    engine: Engine,
    tokenizer: Tokenizer,
    ids: list[int],
    params: SamplingParams,
    constraint: StructuredOutput | None,
    args: argparse.Namespace,
    speculating: bool,
) -> RequestOutput:
    """Stream one prompt's answer (or print its JSON line) and its statistics line."""
    request_id = None
    first = True
    # The engine reads `show_probs` at every pass, and candidates take a pass off the
    # greedy fast path: --first-probs asks them of the first step only.
    engine.show_probs = max(args.show_probs, args.first_probs)
    for event in engine.generate(ids, params, RequestOptions(structured_output=constraint)):
        request_id = event.request_id
        if first and event.token_id is not None:
            first = False
            engine.show_probs = args.show_probs
            if args.first_probs and event.candidates is not None:
                step = show_step(tokenizer, event.token_id, event.candidates[: args.first_probs])
                print(f"first token: {step}", file=sys.stderr, flush=True)
        if args.json:
            continue
        if args.show_probs:
            if event.token_id is not None and event.candidates is not None:
                candidates = event.candidates[: args.show_probs]
                print(show_step(tokenizer, event.token_id, candidates), flush=True)
        else:
            print(event.text, end="", flush=True)
    assert request_id is not None
    out = engine.output(request_id)
    if args.json:
        result = output_json(
            out, args.top_logprobs is not None, speculating, constraint is not None
        )
        print(json.dumps(result), flush=True)
        if out.error:
            print(f"decodespec: error: {out.error}", file=sys.stderr)
        return out
    if args.show_probs:
        print(f"\n{out.text}")
    else:
        print()
    if out.logprobs:
        for lp in out.logprobs:
            token = tokenizer.decode([lp.token_id], skip_special_tokens=False)
            print(f"{token!r:>16} logprob {lp.logprob:8.4f} rank {lp.rank}", file=sys.stderr)
    rate = f"{out.tokens_per_s:.1f} tokens/s" if out.tokens_per_s else "- tokens/s"
    ttft = f"{out.ttft_s:.2f} s" if out.ttft_s is not None else "-"
    speculation = ""
    if speculating:
        accepted = f"{out.acceptance_rate:.0%}" if out.acceptance_rate is not None else "-"
        speculation = (
            f", {args.speculate}: {accepted} of {out.draft_tokens} drafts accepted, "
            f"{out.tokens_per_target_pass or 0:.2f} tokens per target pass"
        )
    print(
        f"[{out.completion_tokens} tokens, finish: {out.finish_reason}, seed: {out.seed}, "
        f"TTFT {ttft}, {rate}, prompt {out.prompt_tokens} tokens ({out.cached_tokens} cached), "
        f"backend {args.backend}{', naive' if args.naive else ''}{speculation}]",
        file=sys.stderr,
        flush=True,
    )
    if out.error:
        print(f"decodespec: error: {out.error}", file=sys.stderr)
    return out
