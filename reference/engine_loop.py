"""One engine, many asyncio callers: the engine's steps run in a thread of their own.

The server's handlers run on an asyncio event loop; the engine is synchronous
PyTorch. `EngineLoop` owns the engine and calls it from one background thread
only: it takes new requests and aborts from a queue between steps, runs
`step()` while any request is unfinished, and hands each event to the asyncio
queue of the request's `Stream`. Every connected client's request joins the
same continuous batch — concurrent requests share forward passes, and no lock
is held around a whole generation. PyTorch releases the GIL inside its
kernels, so the event loop stays responsive while a pass runs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

from decodespec.spec.params import SamplingParams

from .engine import Engine
from .request import RequestOutput, RequestStepOutput
from .request_options import RequestOptions

log = logging.getLogger("decodespec.serve")


@dataclass
class Stream:
    """The events of one request, as the engine thread produces them.

    `events()` yields them on the event loop; the last one has a
    `finish_reason`, and `output` (text, ids, timings) is set by then.
    """

    request_id: int
    _loop: asyncio.AbstractEventLoop
    _queue: asyncio.Queue[RequestStepOutput] = field(default_factory=asyncio.Queue)
    output: RequestOutput | None = None

    def _put(self, event: RequestStepOutput, output: RequestOutput | None) -> None:
        # Runs on the event loop (call_soon_threadsafe), so `output` is set before
        # the reader sees the event that finishes the request.
        if output is not None:
            self.output = output
        self._queue.put_nowait(event)

    async def events(self) -> AsyncIterator[RequestStepOutput]:
        while True:
            event = await self._queue.get()
            yield event
            if event.finish_reason is not None:
                return


@dataclass
class _Add:
    prompt_ids: list[int]
    params: SamplingParams
    options: RequestOptions | None
    loop: asyncio.AbstractEventLoop
    accepted: asyncio.Future[Stream]


class EngineLoop:
    """Runs `engine` in a background thread for asyncio callers.

    Example:
        >>> loop = EngineLoop(engine)                                 # doctest: +SKIP
        >>> stream = await loop.submit(prompt_ids, SamplingParams())  # doctest: +SKIP
        >>> async for event in stream.events(): print(event.text)     # doctest: +SKIP
        >>> loop.close()                                              # doctest: +SKIP
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._inbox: queue.SimpleQueue[_Add | int | None] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[int, Stream] = {}
        self._closed = False
        self.error: BaseException | None = None  # what stopped the thread, if anything
        self._thread = threading.Thread(target=self._run, name="decodespec-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    async def submit(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        options: RequestOptions | None = None,
    ) -> Stream:
        """Queue a request; its `Stream` once the engine has accepted it. `options`
        are `Engine.add_request`'s.

        Raises:
            TypeError, ValueError: the engine refused the request (`Engine.add_request`).
            RuntimeError: the engine loop has stopped.
        """
        if self._closed or not self.alive:
            raise RuntimeError("the engine loop has stopped")
        loop = asyncio.get_running_loop()
        accepted: asyncio.Future[Stream] = loop.create_future()
        options = options or RequestOptions()
        if options.arrival is None:  # now, not when the engine's thread takes it
            options = dataclasses.replace(options, arrival=time.perf_counter())
        add = _Add(list(prompt_ids), params, options, loop, accepted)
        self._send(add)
        return await accepted

    def abort(self, request_id: int) -> None:
        """End the request (a client went away); its cache blocks go back at once."""
        self._send(request_id)

    def close(self, timeout: float = 30.0) -> None:
        """Stop the thread after the current step; unfinished requests are aborted."""
        self._closed = True
        self._send(None)
        self._thread.join(timeout)

    def _send(self, message: _Add | int | None) -> None:
        self._inbox.put(message)
        self._wake.set()

    # -- the engine thread

    def _run(self) -> None:
        try:
            while True:
                self._wake.clear()  # before draining: a message sent after wakes the wait
                if not self._take_messages():
                    break
                if self.engine.has_unfinished():
                    self._deliver(self.engine.step())
                else:
                    self._wake.wait()
        except BaseException as error:  # a bug of the engine itself, not of one request
            self.error = error
            log.exception("the engine loop stopped")
        finally:
            self._shut_down()

    def _take_messages(self) -> bool:
        """Add and abort what the handlers sent; False when asked to stop."""
        while True:
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return True
            if message is None:
                return False
            if isinstance(message, int):
                stream = self._streams.get(message)
                if stream is not None and self.engine.abort(message):
                    self._finish(stream, RequestStepOutput(None, "", "abort", request_id=message))
                continue
            self._add(message)

    def _add(self, add: _Add) -> None:
        try:
            request_id = self.engine.add_request(add.prompt_ids, add.params, add.options)
        except (TypeError, ValueError) as error:
            _call(add.loop, self._settle, add.accepted, None, error)
            return
        stream = Stream(request_id, add.loop)
        self._streams[request_id] = stream
        _call(add.loop, self._settle, add.accepted, stream, None)

    def _deliver(self, events: list[RequestStepOutput]) -> None:
        for event in events:
            stream = self._streams.get(event.request_id)
            if stream is None:
                continue
            if event.finish_reason is None:
                _call(stream._loop, stream._put, event, None)
            else:
                self._finish(stream, event)

    def _finish(self, stream: Stream, event: RequestStepOutput) -> None:
        del self._streams[stream.request_id]
        output = self.engine.release(stream.request_id)
        if event.error is not None and output.error is None:  # ended by the loop itself
            output = dataclasses.replace(output, finish_reason="error", error=event.error)
        _call(stream._loop, stream._put, event, output)

    def _shut_down(self) -> None:
        self._closed = True
        for request_id, stream in list(self._streams.items()):
            self.engine.abort(request_id)
            message = "the server is shutting down" if self.error is None else repr(self.error)
            self._finish(
                stream, RequestStepOutput(None, "", "error", request_id=request_id, error=message)
            )
        while True:  # requests sent after the last drain: refuse them
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(message, _Add):
                error = RuntimeError("the engine loop has stopped")
                _call(message.loop, self._settle, message.accepted, None, error)

    def _settle(
        self, accepted: asyncio.Future[Stream], stream: Stream | None, error: Exception | None
    ) -> None:
        """On the event loop: hand the submitter its stream or the refusal."""
        if accepted.cancelled():  # the handler went away while the request was queued
            if stream is not None:
                self.abort(stream.request_id)
        elif error is not None:
            accepted.set_exception(error)
        else:
            accepted.set_result(stream)


def _call(loop: asyncio.AbstractEventLoop, callback: Callable[..., None], *args: object) -> None:
    """Run `callback(*args)` on the event loop, from the engine thread; nothing if the
    loop has closed (nobody is left to tell)."""
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:
        pass
