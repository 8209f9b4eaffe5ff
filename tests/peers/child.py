"""A native peer in a process of its own: when it crashes, one test fails, naming the
peer and the signal, and the suite goes on.

A peer built from C (llama.cpp) that dies in a test worker takes the worker with
it: SIGILL from an instruction the CPU does not run, SIGSEGV from a bad pointer.
pytest-xdist then restarts workers and, with whole files per worker, once hung
at 98% of the suite. So the tests call such a peer's module through
`PeerProcess`: the module is imported in a child Python process, each call's
arguments and result cross a pipe (pickled: tensors, lists, dicts), and

- a child that dies raises `PeerCrashed` ("llama.cpp died of SIGILL (illegal
  instruction) in tests.peers.llama_cpp_ops.greedy()"), and the next call starts
  a fresh child;
- a call that does not answer within `timeout_s` kills the child and raises
  `PeerTimeout`;
- an exception inside the peer is raised again in the caller, as it was.

    with PeerProcess("tests.peers.llama_cpp_ops", peer="llama.cpp") as ops:
        ops.greedy(torch.tensor([[0.5, 2.0]]))      # tensor([1]), computed in the child
        ops.PEER["name"]                            # a value, fetched once

The child runs `python -m tests.peers.child MODULE READ_FD WRITE_FD` in the
repository root, with the parent's environment.
"""

from __future__ import annotations

import importlib
import os
import pickle
import signal
import subprocess
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, NoReturn

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 300.0  # importing torch and a peer on a busy 2-core machine
CALL_TIMEOUT_S = 600.0


class PeerCrashed(RuntimeError):
    """The peer's process died while it ran a call."""


class PeerTimeout(RuntimeError):
    """The peer's process did not answer a call in time; it was killed."""


def death(returncode: int) -> str:
    """'SIGILL (illegal instruction)' for a process ended by signal 4, 'exit status 3'
    for one that exited."""
    if returncode >= 0:
        return f"exit status {returncode}"
    try:
        number = signal.Signals(-returncode)
    except ValueError:
        return f"signal {-returncode}"
    return f"{number.name} ({signal.strsignal(number).lower()})"


class PeerProcess:
    """The functions and values of module `module`, run in a child process (the module
    docstring says how a crash, a hang and an error come back)."""

    def __init__(self, module: str, peer: str, timeout_s: float = CALL_TIMEOUT_S) -> None:
        self._module, self._peer, self._timeout_s = module, peer, timeout_s
        self._process: subprocess.Popen | None = None
        self._conn: Connection | None = None

    # ------------------------------------------------------------ the child

    def _start(self) -> None:
        child_reads, we_write = os.pipe()
        we_read, child_writes = os.pipe()
        command = [sys.executable, "-m", "tests.peers.child", self._module]
        command += [str(child_reads), str(child_writes)]
        self._process = subprocess.Popen(
            command, cwd=ROOT, pass_fds=(child_reads, child_writes), stdin=subprocess.DEVNULL
        )
        os.close(child_reads)
        os.close(child_writes)
        self._conn = _Duplex(read_fd=we_read, write_fd=we_write)
        try:
            self._receive("start", START_TIMEOUT_S)
        except BaseException:  # the import failed: the child has nothing to serve
            self._stop()
            raise

    def _stop(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self._process is not None:
            if self._process.poll() is None:
                self._process.kill()
            self._process.wait()
            self._process = None

    def _receive(self, what: str, timeout_s: float) -> Any:
        assert self._conn is not None and self._process is not None
        deadline = time.monotonic() + timeout_s
        while not self._conn.poll(0.05):
            if self._process.poll() is not None:
                self._crashed(what)
            if time.monotonic() > deadline:
                self._stop()
                raise PeerTimeout(f"{self._peer}: {self._module} {what} took over {timeout_s} s")
        try:
            kind, value = self._conn.recv()
        except EOFError:  # it closed the pipe as it died
            self._process.wait(timeout=60)
            self._crashed(what)
        if kind == "error":
            raise value
        return value

    def _crashed(self, what: str) -> NoReturn:
        assert self._process is not None
        code = self._process.returncode
        self._stop()
        raise PeerCrashed(
            f"{self._peer} died of {death(code)} in {self._module} {what}; its output is "
            "above. A peer built with instructions this CPU or its OS does not run dies of "
            "SIGILL: see tests/peers/llama_build.py"
        )

    def _ask(self, request: tuple, what: str) -> Any:
        if self._process is None:
            self._start()
        assert self._conn is not None
        self._conn.send(request)
        return self._receive(what, self._timeout_s)

    # ------------------------------------------------------------ the module

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        kind, value = self._ask(("get", name), f"{name}")
        if kind == "value":
            return value

        def call(*args: Any, **kwargs: Any) -> Any:
            return self._ask(("call", name, args, kwargs), f"{name}()")

        call.__name__ = name
        return call

    def close(self) -> None:
        self._stop()

    def __enter__(self) -> PeerProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class _Duplex:
    """Two one-way pipes as one connection of plain pickles. (multiprocessing's own
    pickler would send a tensor as a shared-memory handle, which only a process that
    multiprocessing started may open.)"""

    def __init__(self, read_fd: int, write_fd: int) -> None:
        self._read = Connection(read_fd, writable=False)
        self._write = Connection(write_fd, readable=False)

    def poll(self, timeout: float) -> bool:
        return self._read.poll(timeout)

    def recv(self) -> Any:
        return pickle.loads(self._read.recv_bytes())

    def send(self, value: Any) -> None:
        self._write.send_bytes(pickle.dumps(value))

    def close(self) -> None:
        self._read.close()
        self._write.close()


def _answer(module: Any, request: tuple) -> tuple[str, Any]:
    if request[0] == "get":
        value = getattr(module, request[1])
        return ("value", ("callable", None) if callable(value) else ("value", value))
    _, name, args, kwargs = request
    return ("value", getattr(module, name)(*args, **kwargs))


def serve(module_name: str, read_fd: int, write_fd: int) -> None:
    """The child's loop: import the module, then answer requests until the pipe closes."""
    conn = _Duplex(read_fd=read_fd, write_fd=write_fd)
    try:
        module = importlib.import_module(module_name)
    except BaseException as error:
        conn.send(("error", error))
        return
    conn.send(("value", None))
    while True:
        try:
            request = conn.recv()
        except EOFError:
            return
        try:
            answer = _answer(module, request)
        except Exception as error:
            answer = ("error", error)
        try:
            conn.send(answer)
        except Exception as error:  # an unpicklable result or exception
            conn.send(("error", RuntimeError(f"{module_name}: {error!r}")))


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
