"""A live `decodespec serve` for tests: uvicorn on 127.0.0.1, a free port, in a thread.

The server is the real ASGI stack over a real engine with the bundled model;
tests talk to it over loopback with the official `openai` client, httpx, or
a browser. `LiveServer.engine` lets a test look inside (free cache blocks).
"""

from __future__ import annotations

import threading
import time
from types import TracebackType

import uvicorn

from decodespec.reference.backend import DEFAULT_BACKEND
from decodespec.reference.engine import Engine
from decodespec.reference.loader import load_model
from decodespec.reference.model_files import bundled_model_path
from decodespec.reference.server import create_app

MODEL = "smollm2"
START_TIMEOUT_S = 60


class LiveServer:
    """`with LiveServer() as server:` serves the bundled model at `server.url`."""

    def __init__(self, weights: str | None = "auto", **engine_options: object) -> None:
        """`weights`: the bundled model's weight format (`loader.load_model`'s; by
        default its own, as `decodespec serve` loads it)."""
        weights, tokenizer = load_model(bundled_model_path(), weights=weights)
        engine_options.setdefault("backend", DEFAULT_BACKEND)  # as `decodespec serve` runs
        self.engine = Engine(weights, tokenizer, seed=0, **engine_options)
        self.tokenizer = tokenizer
        config = uvicorn.Config(
            create_app(self.engine, MODEL), host="127.0.0.1", port=0, access_log=False,
            log_level="warning", lifespan="on",
        )  # fmt: skip
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="uvicorn", daemon=True)
        self.url = ""

    @property
    def base_url(self) -> str:
        """The `base_url` of an OpenAI client."""
        return f"{self.url}/v1"

    def __enter__(self) -> LiveServer:
        self._thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.05)
        port = self._server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._server.should_exit = True
        self._thread.join(30)

    def free_blocks(self) -> int:
        """Free cache blocks now (all of them when no request is in flight)."""
        assert self.engine.cache is not None
        return self.engine.block_manager.allocator.num_free

    def total_blocks(self) -> int:
        assert self.engine.cache is not None
        return self.engine.block_manager.allocator.num_blocks

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Until the engine has no unfinished request (aborts land between steps)."""
        deadline = time.monotonic() + timeout
        while self.engine.has_unfinished() or self.engine.requests:
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"the engine still holds requests {sorted(self.engine.requests)}"
                )
            time.sleep(0.05)
