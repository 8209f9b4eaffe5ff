"""`decodespec serve`: the OpenAI-compatible server (`server.py`) on a socket that
listens before the model loads."""

from __future__ import annotations

import argparse
import socket
import sys
from pathlib import Path

from .backend import BACKENDS, DEFAULT_BACKEND, get_backend
from .cli_options import (
    add_batch_invariant_flag,
    add_budget_flags,
    add_grammar_backend_flag,
    add_weights_flag,
    budget_options,
    load_model_with_progress,
    speculation,
    torch_device,
)
from .engine import Engine
from .model_files import bundled_model_path


def add_command(commands) -> None:  # noqa: ANN001 (argparse's private subparsers type)
    """The `serve` subcommand of `decodespec`."""
    srv = commands.add_parser("serve", help="an OpenAI-compatible server with a viewer page")
    srv.add_argument("--model", help="GGUF file or Hugging Face directory (default: bundled)")
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1)")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--served-model-name", help="the model's name in the API (default: file name)")
    srv.add_argument(
        "--backend",
        choices=BACKENDS,
        default=DEFAULT_BACKEND,
        help=f"as for generate (default {DEFAULT_BACKEND})",
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
    add_budget_flags(srv)
    add_batch_invariant_flag(srv)
    srv.set_defaults(run=serve)


def served_model_name(path: str | None) -> str:
    """The name clients ask for: the file's or directory's name, without `.gguf`."""
    model = Path(path) if path is not None else bundled_model_path()
    return model.name.removesuffix(".gguf")


def serve(args: argparse.Namespace) -> int:
    import logging

    import uvicorn  # only this command needs the ASGI stack

    from .server import create_app

    speculate, draft_path = speculation(args.speculate)
    if args.num_draft < 1:
        raise ValueError(f"--num-draft must be >= 1, got {args.num_draft}")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    device = torch_device(args.device)
    get_backend(args.backend)
    budget = budget_options(args)
    listening = listen(args.host, args.port)  # a taken port fails now, not after loading
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
        batch_invariant=args.batch_invariant,
        **budget,
    )
    del weights, draft_model  # the engine holds the backend's copies (weight_formats)
    print(f"path: {engine.path}", file=sys.stderr)
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


def listen(host: str, port: int) -> socket.socket:
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
