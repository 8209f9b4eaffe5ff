"""decodespec command line.

`decodespec generate PROMPT` streams a completion from the bundled
SmolLM2-135M-Instruct (or `--model PATH`); `decodespec serve` answers the
OpenAI API; `decodespec perplexity` scores a text with each weight format
(`perplexity.py`); `decodespec demo` shows the sampling stage on example
logits. The console script enters through `__main__.py`, which takes over
Ctrl-C before this module is imported.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import socket
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from decodespec.spec.forward import ModelWeights
from decodespec.spec.generate import TokenLogprobs
from decodespec.spec.params import MAX_TOP_LOGPROBS, PARAMETERS, SamplingParams, sampling_tensors
from decodespec.spec.sampling import process_logits, sample
from decodespec.spec.softmax import softmax

from . import loader, perplexity
from .backend import BACKENDS, SERVE_BACKEND, get_backend
from .engine import Engine
from .grammar import DEFAULT_BACKEND as DEFAULT_GRAMMAR_BACKEND
from .grammar import StructuredOutput
from .grammar_backends import BACKENDS as GRAMMAR_BACKENDS
from .model_files import bundled_model_path
from .request import RequestOutput
from .tokenizer import Tokenizer
from .weight_formats import WEIGHT_FORMATS, LoadSummary, describe

# ---------------------------------------------------------------- loading


def load_model_with_progress(
    path: str | None, weights: str | None = None
) -> tuple[ModelWeights, Tokenizer]:
    """The model at `path` (default: bundled) in weight format `weights`, with
    progress on stderr; what the format kept and what it quantized is always said."""
    model = Path(path) if path is not None else bundled_model_path()
    start = time.perf_counter()
    live = sys.stderr.isatty()  # redraw one status line on a terminal, else stay quiet

    def report(message: str) -> None:
        if isinstance(message, LoadSummary):
            print(f"\r\033[K{message}" if live else message, file=sys.stderr, flush=True)
        elif live:
            print(f"\r\033[K{message}", end="", file=sys.stderr, flush=True)

    if live:
        report(f"loading {model.name} ...")
    else:
        print(f"loading {model.name} ...", file=sys.stderr, flush=True)
    loaded, tokenizer = loader.load_model(model, weights=weights, progress=report)
    end = "\r\033[K" if live else ""
    print(f"{end}loaded {model.name} in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return loaded, tokenizer


def prompt_ids(
    tokenizer: Tokenizer, prompt: str, raw: bool, system: str | None = None
) -> list[int]:
    """The prompt's token ids, wrapped in the model's chat template (after the `system`
    message, if any) unless `raw`."""
    if raw or tokenizer.chat_template is None:
        if system is not None:
            raise ValueError("a system message needs the chat template (not raw)")
        return tokenizer.encode(prompt)
    messages = [{"role": "system", "content": system}] if system is not None else []
    text = tokenizer.apply_chat_template([*messages, {"role": "user", "content": prompt}])
    return tokenizer.encode(text, add_special_tokens=False)


# ---------------------------------------------------------------- generate


def add_sampling_flags(
    parser: argparse.ArgumentParser, names: Sequence[str] | None = None, **defaults: object
) -> None:
    """An option for each parameter that `SamplingParams` declares a flag for (those
    of `names`, if given), with the field's default unless `defaults` gives another."""
    for name, declared in PARAMETERS.items():
        if declared.flag is None or (names is not None and name not in names):
            continue
        about = {"dest": name, "help": declared.help}
        if declared.type is bool:
            parser.add_argument(declared.flag, action="store_true", **about)
        elif declared.type is tuple:  # a sequence: one value per use of the flag
            parser.add_argument(
                declared.flag, action="append", default=[], metavar=declared.metavar, **about
            )
        else:
            default = defaults.get(name, SamplingParams.__dataclass_fields__[name].default)
            parser.add_argument(
                declared.flag, type=declared.type, default=default, metavar=declared.metavar,
                **about,
            )  # fmt: skip


def _params(args: argparse.Namespace) -> SamplingParams:
    """The parameters the command's sampling flags give."""
    given = {name: getattr(args, name) for name in PARAMETERS if hasattr(args, name)}
    return SamplingParams(**given)


def _logprobs_json(lp: TokenLogprobs, constrained: bool) -> dict:
    """A token's logprobs; under a grammar each alternative says whether it was allowed."""
    top = [{"token_id": t, "logprob": p} for t, p in lp.top]
    if constrained:
        for alternative in top:
            alternative["allowed"] = alternative["token_id"] not in lp.removed
    return {"token_id": lp.token_id, "logprob": lp.logprob, "rank": lp.rank, "top": top}


def _output_json(
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
    }
    if speculating:
        result["draft_tokens"] = out.draft_tokens
        result["accepted_tokens"] = out.accepted_tokens
        result["acceptance_rate"] = out.acceptance_rate
        result["tokens_per_target_pass"] = out.tokens_per_target_pass
    if out.error:
        result["error"] = out.error
    if show_logprobs and out.logprobs is not None:
        result["logprobs"] = [_logprobs_json(lp, constrained) for lp in out.logprobs]
    return result


def _show_step(tokenizer: Tokenizer, token: int, candidates: list[tuple[int, float]]) -> str:
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


def _device(name: str) -> torch.device:
    """`auto` is the GPU when there is one, else the CPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available")
    return torch.device(name)


def _speculation(spec: str | None) -> tuple[str | None, str | None]:
    """`--speculate` as the engine's `speculate` and the draft model's path."""
    if spec is None or spec == "ngram":
        return spec, None
    if spec.startswith("layers:"):
        if not spec.removeprefix("layers:").isdigit():
            raise ValueError(f"--speculate {spec}: N of layers:N must be a positive integer")
        return spec, None
    if spec.startswith("model:") and len(spec) > len("model:"):
        path = spec.removeprefix("model:")
        if not Path(path).exists():
            raise ValueError(f"--speculate {spec}: no file or directory {path}")
        return "model", path
    raise ValueError(f"--speculate must be ngram, layers:N or model:PATH, got {spec!r}")


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
            "grammar", source=_read(args.grammar, "--grammar"), field="--grammar"
        )
    if args.json_schema is None:
        return None
    text = args.json_schema
    if not text.lstrip().startswith("{"):  # a file's name, not the schema itself
        text = _read(text, "--json-schema")
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"--json-schema: not JSON: {error}") from None
    if not isinstance(schema, dict):
        raise ValueError("--json-schema: a JSON Schema is a JSON object")
    return StructuredOutput.json_schema(schema, field="--json-schema")


def _read(path: str, flag: str) -> str:
    try:
        return Path(path).read_text()
    except OSError as error:
        raise ValueError(f"{flag} {path}: {error.strerror or error}") from None


def generate(args: argparse.Namespace) -> int:
    # Everything that can be checked without the model fails before it loads.
    params = _params(args)
    constraint = structured_output(args)
    if args.raw and args.system is not None:
        raise ValueError("--system needs the chat template: it cannot be used with --raw")
    speculate, draft_path = _speculation(args.speculate)
    if args.num_draft < 1:
        raise ValueError(f"--num-draft must be >= 1, got {args.num_draft}")
    device = _device(args.device)
    backend = get_backend(args.backend)
    if not 0 <= args.show_probs <= MAX_TOP_LOGPROBS:
        raise ValueError(f"--show-probs must be in [0, {MAX_TOP_LOGPROBS}], got {args.show_probs}")
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
    )
    del weights  # the engine holds the backend's copy (weight_formats)
    print(f"weights: {describe(engine.weights)}", file=sys.stderr)
    failed = False
    for prompt in args.prompt:  # one engine: a later prompt reuses the earlier ones' prefix
        ids = prompt_ids(tokenizer, prompt, args.raw, args.system)
        out = _answer(engine, tokenizer, ids, params, constraint, args, speculate is not None)
        failed = failed or out.error is not None
    return 1 if failed else 0


def _answer(
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
    for event in engine.generate(ids, params, constraint):
        request_id = event.request_id
        if args.json:
            continue
        if args.show_probs:
            if event.token_id is not None and event.candidates is not None:
                print(_show_step(tokenizer, event.token_id, event.candidates), flush=True)
        else:
            print(event.text, end="", flush=True)
    assert request_id is not None
    out = engine.output(request_id)
    if args.json:
        result = _output_json(
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


# ---------------------------------------------------------------- serve


def served_model_name(path: str | None) -> str:
    """The name clients ask for: the file's or directory's name, without `.gguf`."""
    model = Path(path) if path is not None else bundled_model_path()
    return model.name.removesuffix(".gguf")


def serve(args: argparse.Namespace) -> int:
    import logging

    import uvicorn  # only this command needs the ASGI stack

    from .server import create_app

    speculate, draft_path = _speculation(args.speculate)
    if args.num_draft < 1:
        raise ValueError(f"--num-draft must be >= 1, got {args.num_draft}")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    device = _device(args.device)
    get_backend(args.backend)
    listening = _listen(args.host, args.port)  # a taken port fails now, not after loading
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    weights, tokenizer = load_model_with_progress(args.model, args.weights)
    draft_model = (
        load_model_with_progress(draft_path, args.weights)[0] if draft_path is not None else None
    )
    engine = Engine(
        weights.to(device),
        tokenizer,
        backend=args.backend,
        cache_tokens=args.cache_tokens,
        prefix_caching=not args.no_prefix_caching,
        speculate=speculate,
        num_draft=args.num_draft,
        draft_model=draft_model.to(device) if draft_model is not None else None,
        grammar_backend=args.grammar_backend,
    )
    del weights, draft_model  # the engine holds the backend's copies (weight_formats)
    print(f"weights: {describe(engine.weights)}", file=sys.stderr)
    name = args.served_model_name or served_model_name(args.model)
    host, port = listening.getsockname()[:2]
    print(f"serving {name} on http://{host}:{port} (viewer at /)", file=sys.stderr)
    config = uvicorn.Config(
        create_app(engine, name), access_log=False, log_level="warning", lifespan="on"
    )
    uvicorn.Server(config).run(sockets=[listening])
    return 0


# uvicorn's default backlog: the connections the kernel queues before the first accept
BACKLOG = 2048


def _listen(host: str, port: int) -> socket.socket:
    """A socket listening on host:port, or a ValueError saying why not.

    It listens from here on: a client that connects once the URL is printed is
    queued by the kernel until uvicorn accepts it, never refused, however long
    the model takes to load and uvicorn to start.
    """
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        listening = socket.socket(family, kind, proto)
        listening.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listening.bind(address)
        listening.listen(BACKLOG)
    except OSError as error:
        raise ValueError(f"cannot listen on {host}:{port}: {error.strerror or error}") from None
    return listening


# ---------------------------------------------------------------- demo

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
        f"temperature={params.temperature} top_k={params.top_k} top_p={params.top_p} "
        f"min_p={params.min_p} seed={params.seed}",
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


# ---------------------------------------------------------------- main


def add_weights_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--weights",
        choices=WEIGHT_FORMATS,
        default="float32",
        help="weight format: float32 (default, the reference), bfloat16, int8 (per channel) "
        "or int4 (groups of 32; a GGUF file's own 4-bit blocks kept): the int formats run on "
        "PyTorch's CPU kernels with the torch backend",
    )


def add_grammar_backend_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--grammar-backend",
        choices=GRAMMAR_BACKENDS,
        default=DEFAULT_GRAMMAR_BACKEND,
        help=f"the library that compiles structured outputs (default {DEFAULT_GRAMMAR_BACKEND})",
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="decodespec", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)

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
        default="spec",
        help="stage functions: the spec's PyTorch (default), the same with attention "
        "batched across requests (torch), or the Triton kernels",
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
    gen.add_argument("--raw", action="store_true", help="send the prompt without chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON object at the end")
    gen.add_argument(
        "--show-probs", type=int, default=0, metavar="N", help="show the top N candidates per step"
    )
    gen.set_defaults(run=generate)

    srv = commands.add_parser("serve", help="an OpenAI-compatible server with a viewer page")
    srv.add_argument("--model", help="GGUF file or Hugging Face directory (default: bundled)")
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1)")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--served-model-name", help="the model's name in the API (default: file name)")
    srv.add_argument(
        "--backend",
        choices=BACKENDS,
        default=SERVE_BACKEND,
        help="as for generate; default torch: the spec's stages with attention batched "
        "across the requests of a step",
    )
    srv.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    add_weights_flag(srv)
    srv.add_argument(
        "--cache-tokens", type=int, default=16_384, help="KV cache capacity in positions"
    )
    srv.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="prefill every prompt whole: no reuse of the blocks of a prefix another "
        "request computed (prefix caching is on by default)",
    )
    srv.add_argument("--speculate", metavar="DRAFTER", help="as for generate")
    srv.add_argument("--num-draft", type=int, default=4, metavar="K")
    add_grammar_backend_flag(srv)
    srv.set_defaults(run=serve)

    perplexity.add_command(commands)

    show = commands.add_parser("demo", help="the sampling stage on example logits")
    add_sampling_flags(show, ["temperature", "top_k", "top_p", "min_p", "seed"], top_p=0.9, seed=0)
    show.add_argument("--draws", type=int, default=12)
    show.set_defaults(run=_demo)
    return parser


def _demo(args: argparse.Namespace) -> int:
    print(demo(_params(args), args.draws))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, FileNotFoundError) as error:
        # Bad input is the user's to fix: a clear message, no traceback.
        print(f"decodespec: error: {error}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # The reader went away (`| head`): stop quietly. Point stdout at /dev/null so
        # the interpreter's final flush does not raise again.
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError, io.UnsupportedOperation):
            pass  # stdout is not a file descriptor (tests)
        return 1
