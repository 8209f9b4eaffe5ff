"""Copy the public yardsticks the grammar tests use into this folder (run once; the copies
are committed, so tests and benches never reach the network).

    python tests/grammar/data/vendor.py SUITE_CHECKOUT BENCH_CHECKOUT

SUITE_CHECKOUT is a checkout of json-schema-org/JSON-Schema-Test-Suite; its
`tests/draft2020-12` cases (the required ones and `optional/format`) and its
licence are copied to `json-schema-test-suite/`. BENCH_CHECKOUT is a checkout of
guidance-ai/jsonschemabench (the data of "Generating Structured Outputs from Language
Models: Benchmark and Studies", MIT licence on its dataset card); a fixed subset of
its `data/` sets is copied to `jsonschemabench/`: from each set in `SETS`, the
`PER_SET` schemas of under `MAX_BYTES` bytes that come first in the order of the
SHA-256 of their path (a fixed pseudo-random draw, not a choice by hand). The size
bound keeps the bench's generations within minutes; it leans to smaller schemas.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent
SETS = (
    "Glaiveai2K",
    "Github_trivial",
    "Github_easy",
    "Github_medium",
    "Github_hard",
    "Snowplow",
    "Kubernetes",
    "WashingtonPost",
    "JsonSchemaStore",
)
PER_SET = 14
MAX_BYTES = 8000


def _commit(checkout: Path) -> str:
    return subprocess.run(
        ["git", "-C", str(checkout), "rev-parse", "HEAD"], capture_output=True, text=True
    ).stdout.strip()


def vendor_suite(checkout: Path) -> None:
    target = HERE / "json-schema-test-suite"
    shutil.rmtree(target, ignore_errors=True)
    source = checkout / "tests" / "draft2020-12"
    for path in [*source.glob("*.json"), *(source / "optional" / "format").glob("*.json")]:
        out = target / path.relative_to(source)
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, out)
    shutil.copyfile(checkout / "LICENSE", target / "LICENSE")
    (target / "SOURCE").write_text(
        f"json-schema-org/JSON-Schema-Test-Suite {_commit(checkout)} tests/draft2020-12\n"
    )


def vendor_bench(checkout: Path) -> None:
    target = HERE / "jsonschemabench"
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir()
    chosen = {}
    for name in SETS:
        paths = [
            p for p in (checkout / "data" / name).glob("*.json") if p.stat().st_size < MAX_BYTES
        ]
        paths.sort(key=lambda p: hashlib.sha256(f"{name}/{p.name}".encode()).hexdigest())
        for path in paths[:PER_SET]:
            chosen[f"{name}/{path.stem}"] = json.loads(path.read_text())
    (target / "schemas.json").write_text(json.dumps(chosen, indent=1, sort_keys=True) + "\n")
    (target / "SOURCE").write_text(
        f"guidance-ai/jsonschemabench {_commit(checkout)} data/: {PER_SET} schemas of under "
        f"{MAX_BYTES} bytes from each of {', '.join(SETS)} (tests/grammar/data/vendor.py); "
        "dataset licence: MIT (epfl-dlab/JSONSchemaBench)\n"
    )


if __name__ == "__main__":
    vendor_suite(Path(sys.argv[1]))
    vendor_bench(Path(sys.argv[2]))
