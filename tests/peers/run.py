"""`make peers`: run the conformance suite against every peer and write the matrix.

    python -m tests.peers.run [--out results/peers.json] [--only NAME ...]

For each peer of `PEERS` that this machine can run, the suite runs in a
subprocess (`pytest tests/conformance --impl <module> --xfails <module>.xfails
--report ...`), and its clause report becomes one column: per clause, pass,
fail, xfail (with what the peer does instead, from the xfails file) or skip
(with the reason). A peer whose package is not installed, or that needs a
GPU this machine lacks, gets a column of its reason. The llama.cpp column
also carries the loop comparison on the bundled model (tokenizer ids, greedy
tokens, decode tokens/s of both). When llama.cpp runs, the matrix also
carries `mask_order`: llama.cpp's grammar sampler against xgrammar's bitmask
on real grammars, and the tokens mask-first (the spec) and llama.cpp's
chain-first sampling can return (tests/peers/mask_order.py).

`ours` holds the batch-invariance checker (tests/conformance/test_batch_invariance.py)
run the same way on our own implementations: the kernels, the spec's operations,
the engine's torch-backend attention and its native decode step's C attention
(the whole suite of the kernels and of the native step is `make docs-report`'s),
so the matrix says which of ours and the peers' operations compute a row the
same way whatever its batch.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import importlib
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from tests.peers import llama_build
from tests.peers.child import PeerProcess

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
RESULTS = ROOT / "results" / "peers.json"
STATUSES = ("pass", "fail", "xfail", "skip")
# Every file a cell can depend on besides the peer's own package: the spec (the
# reference every test compares with), the conformance suite and its harness, the
# adapters and their xfails files. The matrix records their hashes, and the suite
# (tests/peers/test_matrix.py) refuses a committed matrix whose sources have moved on.
SOURCE_FOLDERS = ("spec", "tests/conformance", "tests/peers")


@dataclass(frozen=True)
class Peer:
    """A column of the matrix: its title, its adapter module (tests/peers/<file>.py), and
    the engine it belongs to, as the stage pages' "Differs from" notes name it."""

    name: str
    module: str
    engine: str

    @property
    def xfails(self) -> Path:
        return HERE / f"{self.module.rsplit('.', 1)[-1]}.xfails"


PEERS = (
    Peer("transformers", "tests.peers.transformers_ops", "Hugging Face"),
    Peer("transformers eager attention", "tests.peers.transformers_eager", "Hugging Face"),
    Peer("transformers SDPA attention", "tests.peers.transformers_sdpa", "Hugging Face"),
    Peer("PyTorch SDPA", "tests.peers.torch_sdpa", "PyTorch"),
    Peer("PyTorch FlexAttention", "tests.peers.torch_flex", "PyTorch"),
    Peer("llama.cpp", "tests.peers.llama_cpp_ops", "llama.cpp"),
    Peer("xgrammar CPU", "tests.peers.xgrammar_cpu", "xgrammar"),
    Peer("xgrammar torch", "tests.peers.xgrammar_torch", "xgrammar"),
    Peer("llguidance numpy", "tests.peers.llguidance_numpy", "llguidance"),
    Peer("llguidance torch", "tests.peers.llguidance_torch", "llguidance"),
    Peer("FlashInfer", "tests.peers.flashinfer_ops", "FlashInfer"),
    Peer("vLLM", "tests.peers.vllm_ops", "vLLM"),
)


# Our implementations, through the invariance checker only.
OURS = (
    Peer("decodespec kernels", "decodespec.kernels", "decodespec"),
    Peer("decodespec spec", "tests.peers.decodespec_spec", "decodespec"),
    Peer("decodespec torch backend", "tests.peers.decodespec_torch", "decodespec"),
    Peer("decodespec native step", "tests.peers.decodespec_native", "decodespec"),
)
INVARIANCE_TESTS = (
    "tests/conformance/test_batch_invariance.py",
    "tests/conformance/test_speculative.py::test_rows_do_not_depend_on_their_batch",
)
SUITE = ("tests/conformance",)


def unavailable(peer: Peer) -> str | None:
    """Why this machine cannot run `peer`, or None."""
    try:
        module = importlib.import_module(peer.module)
    except ImportError as error:
        return f"not installed here ({error})"
    if getattr(module, "PEER_REQUIRES", None) == "cuda" and not torch.cuda.is_available():
        return "needs a CUDA GPU, and this machine has none"
    return None


def peer_info(peer: Peer) -> dict:
    """What the adapter says of its peer: package, version, the functions it calls."""
    try:
        module = importlib.import_module(peer.module)
    except ImportError:
        return {}
    info = dict(getattr(module, "PEER", {}))
    package = info.get("package")
    if package:
        try:
            info["version"] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            info["version"] = "not installed"
    return info


def run_suite(peer: Peer, report: Path, tests: tuple[str, ...] = SUITE) -> tuple[int, float]:
    """The conformance suite (or the `tests` named) against `peer`; its exit status and
    wall time."""
    command = [
        sys.executable,
        "-m",
        "pytest",
        *tests,
        "--impl",
        peer.module,
        "--report",
        str(report),
        "-q",
        "-p",
        "no:cacheprovider",
    ]
    if peer.xfails.exists():
        command += ["--xfails", str(peer.xfails)]
    env = {**os.environ, "HYPOTHESIS_PROFILE": os.environ.get("HYPOTHESIS_PROFILE", "ci")}
    start = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode not in (0, 1):  # 1: some test failed, which the matrix shows
        sys.stderr.write(done.stdout[-4000:] + done.stderr[-4000:])
    return done.returncode, time.perf_counter() - start


def _clause_of_xfail(message: str) -> tuple[str | None, str]:
    """An xfails reason `CLAUSE-ID: what the peer does` split in two."""
    from decodespec.spec import registry

    head, colon, rest = message.partition(":")
    if colon and head.strip() in registry.clauses():
        return head.strip(), rest.strip()
    return None, message


def cell(clause_id: str, tests: list[dict], module: str, name: str) -> dict:
    """One clause of one peer: its status and, unless it passes, one line on why."""
    failed = [t for t in tests if t["outcome"] in ("failed", "error")]
    if failed:
        first = failed[0]
        test = first["nodeid"].split("::")[-1]
        return {"status": "fail", "why": f"{test}: {first.get('message', 'failed')}"}
    own_xfails, other_xfails = [], []
    for test in tests:
        if test["outcome"] == "xfailed":
            clause, reason = _clause_of_xfail(test.get("message", ""))
            (own_xfails if clause == clause_id else other_xfails).append((clause, reason))
    if own_xfails:
        reasons = dict.fromkeys(r.rstrip(".") for _, r in own_xfails)
        return {"status": "xfail", "why": "; ".join(reasons)}
    if any(t["outcome"] in ("passed", "xpassed") for t in tests):
        return {"status": "pass"}
    reasons = [
        t.get("message", "")
        .replace(f"{module} does not provide operation ", f"{name} has no operation ")
        .replace(module, name)
        for t in tests
        if t["outcome"] == "skipped"
    ]
    reasons += [
        f"its tests fail on {clause} first" if clause else f"its tests fail first: {reason}"
        for clause, reason in other_xfails
    ]
    return {"status": "skip", "why": "; ".join(dict.fromkeys(r for r in reasons if r))}


def column(peer: Peer, tests: tuple[str, ...] = SUITE) -> dict:
    """Run `peer` (or say why not) and return its column of the matrix."""
    info = {"module": peer.module, "engine": peer.engine, **peer_info(peer)}
    reason = unavailable(peer)
    if reason is not None:
        return {**info, "ran": False, "why": reason, "clauses": {}}
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "report.json"
        status, seconds = run_suite(peer, path, tests)
        if not path.exists():
            return {**info, "ran": False, "why": f"pytest exited {status}", "clauses": {}}
        report = json.loads(path.read_text())
    clauses = {
        clause_id: cell(clause_id, entry["tests"], peer.module, peer.name)
        for clause_id, entry in report["clauses"].items()
        if entry["tests"]
    }
    counts = {s: sum(c["status"] == s for c in clauses.values()) for s in STATUSES}
    result = {
        **info,
        "ran": True,
        "date": report["date"],
        "exit_status": status,
        "seconds": round(seconds, 1),
        "counts": counts,
        "clauses": clauses,
    }
    if peer.name == "llama.cpp" and tests == SUITE:
        with PeerProcess("tests.peers.llama_cpp_loop", peer="llama.cpp") as loop:
            result["loop"] = loop.compare_loop()
    return result


def sources() -> dict[str, str]:
    """Path -> SHA-256 (16 hex digits) of every file in `SOURCE_FOLDERS`, of the suite's
    harness (tests/*.py) and of the hypothesis profiles. The tests of the harness and of
    the adapters (tests/test_*.py, tests/peers/test_*.py) run no peer and are left out."""
    files = [f for f in (ROOT / "tests").glob("*.py") if not f.name.startswith("test_")]
    for folder in SOURCE_FOLDERS:
        files += [f for f in (ROOT / folder).rglob("*") if f.suffix in (".py", ".xfails")]
    files = [f for f in files if not (f.parent == HERE and f.name.startswith("test_"))]
    hashes = {
        f.relative_to(ROOT).as_posix(): hashlib.sha256(f.read_bytes()).hexdigest()[:16]
        for f in files
    }
    profiles = json.dumps(_hypothesis_profiles(), sort_keys=True).encode()
    hashes["pyproject.toml [tool.hypothesis]"] = hashlib.sha256(profiles).hexdigest()[:16]
    return dict(sorted(hashes.items()))


def _hypothesis_profiles() -> dict:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["hypothesis"]


def matrix(peers: tuple[Peer, ...] = PEERS, ours: tuple[Peer, ...] = OURS) -> dict:
    """Every peer's column, ours through the invariance checker, with the machine and the
    clause texts."""
    from decodespec.spec import registry

    columns = {peer.name: column(peer) for peer in peers}
    our_columns = {peer.name: column(peer, INVARIANCE_TESTS) for peer in ours}
    result = {
        "command": "make peers",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "cpu": llama_build.describe()["cpu"],
            "cores": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        },
        "hypothesis_profile": os.environ.get("HYPOTHESIS_PROFILE", "ci"),
        "sources": sources(),
        "clauses": {
            clause.id: {"module": clause.module}
            for clause in registry.clauses().values()
            if any(clause.id in column["clauses"] for column in columns.values())
        },
        "peers": columns,
        "ours": our_columns,
    }
    if columns.get("llama.cpp", {}).get("ran"):
        with PeerProcess("tests.peers.mask_order", peer="llama.cpp") as mask_order:
            result["mask_order"] = mask_order.compare()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS, help="where to write the matrix")
    parser.add_argument("--only", nargs="*", help="peer names to run (default: all)")
    args = parser.parse_args(argv)
    peers = tuple(p for p in PEERS if not args.only or p.name in args.only)
    ours = tuple(p for p in OURS if not args.only or p.name in args.only)
    known = [p.name for p in (*PEERS, *OURS)]
    unknown = set(args.only or ()) - set(known)
    if unknown:
        parser.error(f"unknown peers {sorted(unknown)}; known: {known}")
    result = matrix(peers, ours)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    columns = {**result["peers"], **result["ours"]}
    for name, col in columns.items():
        summary = col["counts"] if col["ran"] else col["why"]
        print(f"{name:30} {summary}")
    failed = [n for n, c in columns.items() if c["ran"] and c["counts"]["fail"]]
    if failed:
        print(f"unrecorded disagreements (fail cells) in: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
