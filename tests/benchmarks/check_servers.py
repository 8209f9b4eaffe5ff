"""`decodespec check` against three servers on one GGUF: `make check-servers` →
results/check-<server>.json, the table of the site's Peers page.

Each server runs the bundled GGUF (SmolLM2-135M-Instruct, Q4_1) with 2 threads
on 127.0.0.1 at a free port, in a process group of its own
(`versus_llama.ServerProcess`: ready once it answers, ended on leaving its
`with`, errors included):

- `decodespec`: `decodespec serve` with its defaults (only host and port given;
  `versus_llama.decodespec_server`);
- `llama-cpp-python`: `python -m llama_cpp.server` of the venv's llama-cpp-python
  (`make peers` builds it), `--n_threads 2 --n_threads_batch 2 --n_ctx 4096
  --logits_all true`. Its server's own dependencies (the package's `server`
  extra: FastAPI and friends, `SERVER_EXTRA`) are not the project's: they are
  installed once with pip into a folder of their own
  (`~/.cache/decodespec/llama-cpp-python-server/<version>/`), which only that
  process has on its `PYTHONPATH`;
- `llama-server`: llama.cpp's server as `make bench-llama` builds (from source
  on first use, then cached: `versus_llama.build_llama_server`) and starts it
  (`versus_llama.llama_server`: 16 slots, continuous batching), here with a
  context of 16 × 512 positions.

Then `decodespec check --base-url http://127.0.0.1:PORT/v1 --model-file GGUF
--json` runs as a subprocess (it exits 1 when a check fails: that is a result,
not an error) and its report is written with the server's name, version and
command line, the check's command line, the machine and the date. Each check
run is bounded (`CHECK_TIMEOUT_S`), as each server's start is
(`versus_llama.SERVER_START_TIMEOUT_S`); a server that does not start or a
check that does not print a report is reported and the next server runs; the
command then exits 1.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from tests.benchmarks.versus_llama import (
    CACHE,
    PEER_ENV,
    SLOTS,
    ServerProcess,
    build_llama_server,
    decodespec_server,
    free_port,
    llama_server,
    llama_system_info,
    log,
)
from tests.peers import llama_build

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "results"
COMMAND = "python -m tests.benchmarks.check_servers"
MAKE_COMMAND = "make check-servers"
SERVERS = ("decodespec", "llama-cpp-python", "llama-server")
THREADS = 2
LLAMA_CPP_CONTEXT = 4096
LLAMA_SERVER_SLOT_CONTEXT = 512  # positions per slot: a chat prompt and 200 tokens, with room
CHECK_TIMEOUT_S = 1800
PIP_TIMEOUT_S = 900
# llama-cpp-python's `server` extra, pinned (installed apart from the project's venv)
SERVER_EXTRA = (
    "fastapi==0.165.0",
    "pydantic-settings==2.16.3",
    "sse-starlette==3.7.0",
    "starlette-context==0.3.6",
)


def result_path(name: str, results_dir: Path = RESULTS) -> Path:
    return results_dir / f"check-{name}.json"


# ---------------------------------------------------------------- the three servers


def llama_cpp_version() -> str:
    import llama_cpp

    return llama_cpp.__version__


def llama_cpp_server_deps() -> Path:
    """The folder holding llama-cpp-python's server dependencies (`SERVER_EXTRA` and
    theirs), installed with pip on first use."""
    home = CACHE / "llama-cpp-python-server" / llama_cpp_version()
    stamp = home / "installed.json"
    if stamp.exists() and json.loads(stamp.read_text()).get("requirements") == list(SERVER_EXTRA):
        return home / "site"
    log(f"installing llama-cpp-python's server dependencies into {home} ...")
    site = home / "site"
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
         "--upgrade", "--target", str(site), *SERVER_EXTRA],
        capture_output=True, text=True, timeout=PIP_TIMEOUT_S, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(
            f"pip failed ({done.returncode}):\n{(done.stdout + done.stderr)[-3000:]}"
        )
    stamp.write_text(json.dumps({"requirements": list(SERVER_EXTRA)}) + "\n")
    return site


def installed_versions(site: Path) -> dict[str, str]:
    """The distributions pip put in `site`, name to version."""
    found = {}
    for dist in importlib.metadata.distributions(path=[str(site)]):
        found[dist.metadata["Name"]] = dist.version
    return dict(sorted(found.items(), key=lambda item: item[0].lower()))


def llama_cpp_python_server(model: Path, log_dir: Path) -> tuple[ServerProcess, dict]:
    site = llama_cpp_server_deps()
    port = free_port()
    command = [
        sys.executable, "-m", "llama_cpp.server", "--model", str(model),
        "--host", "127.0.0.1", "--port", str(port),
        "--n_threads", str(THREADS), "--n_threads_batch", str(THREADS),
        "--n_ctx", str(LLAMA_CPP_CONTEXT), "--logits_all", "true",
    ]  # fmt: skip
    path = os.pathsep.join(filter(None, [str(site), PEER_ENV.get("PYTHONPATH")]))
    env = {**PEER_ENV, "PYTHONPATH": path}
    server = ServerProcess(
        "llama-cpp-python server", command, port, "/v1/models", log_dir / "llama-cpp-python.log",
        env,
    )  # fmt: skip
    version = {
        "version": llama_cpp_version(),
        "package": f"llama-cpp-python {llama_cpp_version()}",
        "system_info": llama_system_info(),
        "server_dependencies": installed_versions(site),
    }
    return server, version


def llama_server_process(model: Path, log_dir: Path) -> tuple[ServerProcess, dict]:
    """llama-server as `make bench-llama` builds (once, cached) and starts it."""
    build = build_llama_server()
    binary = Path(build["binary"])
    server = llama_server(binary, model, THREADS, SLOTS * LLAMA_SERVER_SLOT_CONTEXT, log_dir)
    output = build["version_output"]
    return server, {
        "version": output.splitlines()[0].removeprefix("version:").strip(),
        "package": build["package"],
        "version_output": output,
        "build": {key: build[key] for key in ("llama_cpp_tag", "sdist_sha256", "cmake_options")}
        | {"cpu": llama_build.describe()["cpu"]},
    }


def decodespec_process(model: Path, log_dir: Path) -> tuple[ServerProcess, dict]:
    version = importlib.metadata.version("decodespec")
    server = decodespec_server(THREADS, log_dir)
    return server, {
        "version": version,
        "package": f"decodespec {version}",
        "environment": {k: server.env[k] for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")},
    }


STARTERS = {
    "decodespec": decodespec_process,
    "llama-cpp-python": llama_cpp_python_server,
    "llama-server": llama_server_process,
}


# ---------------------------------------------------------------- one run


def run_check(server: ServerProcess, model: Path, timeout_s: float) -> tuple[list[str], dict, int]:
    """`decodespec check --json` against `server`: its command, report and status."""
    command = [sys.executable, "-m", "decodespec.reference", "check",
               "--base-url", server.base_url, "--model-file", str(model), "--json"]  # fmt: skip
    started = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, check=False)
    if done.returncode not in (0, 1):
        raise RuntimeError(
            f"the check exited {done.returncode}:\n{done.stderr[-3000:]}\n{done.stdout[-1000:]}"
        )
    try:
        report = json.loads(done.stdout)
    except ValueError as error:
        raise RuntimeError(
            f"the check printed no JSON report ({error}):\n{done.stdout[-2000:]}"
        ) from None
    report["check_s"] = round(time.monotonic() - started, 1)
    return command, report, done.returncode


def check_server(name: str, model: Path, log_dir: Path, args: argparse.Namespace) -> dict:
    from tests.benchmarks.test_cpu_engine import cpu_report_header

    server, version = STARTERS[name](model, log_dir)
    log(f"starting {name}: {' '.join(server.command)}")
    with server:
        log(f"{name} is ready at {server.base_url}; running decodespec check ...")
        command, report, status = run_check(server, model, args.timeout)
    header = cpu_report_header(f"check-{name}", args.command, None)
    machine = {key: header[key] for key in ("device", "cores")}
    machine["software"] = header["software"]
    return {
        "benchmark": header["benchmark"],
        "command": header["command"],
        "date": header["date"],
        "machine": machine,
        "server": {
            "name": name,
            **version,
            "threads": THREADS,
            "command": server.command,
        },
        "model_file": model.name,
        "check_command": command,
        "check_exit_status": status,
        "counts": counts(report),
        "report": report,
    }


def counts(report: dict) -> dict[str, int]:
    found: dict[str, int] = {}
    for row in report["checks"]:
        found[row["outcome"]] = found.get(row["outcome"], 0) + 1
    return found


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--only", nargs="+", choices=SERVERS, metavar="NAME", default=list(SERVERS),
        help=f"the servers to check (of {', '.join(SERVERS)}; all by default)",
    )  # fmt: skip
    parser.add_argument("--results", type=Path, default=RESULTS, help="folder of the files")
    parser.add_argument(
        "--timeout", type=float, default=CHECK_TIMEOUT_S,
        help=f"seconds for each check run ({CHECK_TIMEOUT_S})",
    )  # fmt: skip
    args = parser.parse_args(argv)
    args.command = " ".join([COMMAND, *argv]) if argv else MAKE_COMMAND
    return args


def main(argv: Sequence[str] | None = None) -> int:
    from decodespec.reference.model_files import bundled_model_path
    from tests.benchmarks.gpu import write_json

    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    # SIGTERM (make interrupted, a time limit) unwinds like Ctrl-C: the servers are ended
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    model = bundled_model_path()
    problems = []
    with tempfile.TemporaryDirectory(prefix="check-servers-") as logs:
        for name in args.only:
            try:
                result = check_server(name, model, Path(logs), args)
            except (RuntimeError, OSError, ImportError, subprocess.SubprocessError) as error:
                problems.append(name)
                log(f"{name}: no report: {error}")
                continue
            path = result_path(name, args.results)
            write_json(path, result)
            summary = ", ".join(f"{n} {o}" for o, n in sorted(result["counts"].items()))
            print(f"{name} {result['server']['version']}: {summary} -> {path}", flush=True)
            for row in result["report"]["checks"]:
                if row["outcome"] != "pass":
                    print(f"  {row['outcome']}: {row['check']}: {row['detail']}", flush=True)
    if problems:
        print(f"no report from: {', '.join(problems)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
