"""Conformance harness: which implementation is under test, and what a run reports.

Options (each also an environment variable):
  --impl MODULE      (DECODESPEC_IMPL)    the module under test; default `decodespec.kernels`.
                     With the default, operations `decodespec.kernels` lacks run as a
                     self-check of the spec and are listed in the header; a
                     module named explicitly gets "missing" skips instead.
  --xfails FILE      (DECODESPEC_XFAILS)  known failures: one test a line,
                     `<nodeid>  # reason`; a nodeid without its `[...]` parameters
                     covers every parametrization. A reason that starts with a
                     clause id (`# SAMPLE-TOPK-2: keeps exactly k tokens`) names
                     the clause the test fails on, which must be one it marks.
  --report FILE      (DECODESPEC_REPORT)  write the clause report (JSON).
HYPOTHESIS_PROFILE selects ci / dev / thorough / mutants (pyproject.toml).
"""

from __future__ import annotations

import datetime
import importlib
import importlib.metadata
import json
import os
import platform
import sys
from pathlib import Path

import pytest
import torch

# Triton reads this when its decorators run, so it is set before anything
# imports the kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist (`make test`), the workers share the machine's cores: each
# worker, and every process its tests start, gets its share of threads, so that
# two workers on two cores do not run four threads that wait on each other.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    _threads = max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    os.environ.setdefault("OMP_NUM_THREADS", str(_threads))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

from hypothesis import Phase, settings

from decodespec.spec import registry
from tests import repro
from tests.strategies import BOUNDARY_FAMILIES

ROOT = Path(__file__).resolve().parent.parent

# A test stuck in C code past its timeout ends its process (tests/watchdog.py).
pytest_plugins = ["tests.watchdog"]


def _load_hypothesis_profiles() -> None:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    for name, values in config["tool"]["hypothesis"]["profiles"].items():
        values = dict(values)
        if values.get("deadline") == "none":
            values["deadline"] = None
        if "phases" in values:
            values["phases"] = [Phase[name] for name in values["phases"]]
        settings.register_profile(name, **values)
    default = "ci" if os.environ.get("CI") else "dev"
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", default))


_load_hypothesis_profiles()


class Implementation:
    """The module under test, and how each operation is resolved."""

    def __init__(self, name: str, explicit: bool) -> None:
        self.name = name
        self.explicit = explicit
        self.import_error: str | None = None
        try:
            self.module = importlib.import_module(name)
        except ImportError as error:
            if explicit:
                raise pytest.UsageError(f"--impl {name}: cannot import: {error}") from error
            self.module = None
            self.import_error = str(error)
        self.missing = [op for op in registry.OPERATIONS if getattr(self.module, op, None) is None]
        self.unsupported: dict[str, str] = dict(
            getattr(self.module, "CONFORMANCE_UNSUPPORTED", {}) or {}
        )
        unknown = set(self.unsupported) - set(registry.FEATURES)
        if unknown:
            raise pytest.UsageError(
                f"{name}.CONFORMANCE_UNSUPPORTED names unknown features {sorted(unknown)}; "
                f"known: {sorted(registry.FEATURES)}"
            )

    @property
    def version(self) -> str:
        version = getattr(self.module, "__version__", None)
        if version:
            return str(version)
        try:
            return importlib.metadata.version("decodespec")
        except importlib.metadata.PackageNotFoundError:
            return "unknown"

    def op(self, name: str):
        """The implementation's function `name`, or the spec's as a self-check."""
        if name not in registry.OPERATIONS:
            raise KeyError(f"{name} is not an operation of the registry")
        function = getattr(self.module, name, None)
        if function is None:
            if self.explicit:
                pytest.skip(f"{self.name} does not provide operation {name}")
            function = registry.OPERATIONS[name].reference
        return repro.recorded(self.source_module(name), name, function)

    def source_module(self, name: str) -> str:
        if getattr(self.module, name, None) is None:
            return registry.OPERATIONS[name].module
        return self.name

    def supports(self, feature: str) -> bool:
        """Whether the implementation has `feature` (it does unless it declares otherwise)."""
        if feature not in registry.FEATURES:
            raise KeyError(f"unknown feature {feature}")
        return feature not in self.unsupported

    def require(self, feature: str) -> None:
        """Skip the calling test if the implementation declares `feature` unsupported."""
        if feature not in registry.FEATURES:
            raise KeyError(f"unknown feature {feature}")
        if feature in self.unsupported:
            pytest.skip(f"{self.name} does not support {feature}: {self.unsupported[feature]}")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("decodespec conformance")
    group.addoption("--impl", default=None, help="module under test (default: decodespec.kernels)")
    group.addoption("--xfails", default=None, help="file of known failures")
    group.addoption("--report", default=None, help="write the clause report JSON here")
    group.addoption(
        "--benchmarks", action="store_true", help="run tests/benchmarks (skipped otherwise)"
    )


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    # Benchmarks measure, they do not test: collected only when asked for.
    if "benchmarks" in collection_path.parts and not config.getoption("--benchmarks"):
        return True
    return None


def _option(config: pytest.Config, name: str) -> str | None:
    return config.getoption(name) or os.environ.get(f"DECODESPEC_{name.upper()}") or None


def pytest_configure(config: pytest.Config) -> None:
    name = _option(config, "impl")
    config._decodespec_impl = Implementation(
        name or "decodespec.kernels", explicit=name is not None
    )
    path = _option(config, "report")
    if path:
        config.pluginmanager.register(ClauseReport(path, config._decodespec_impl))


def pytest_report_header(config: pytest.Config) -> list[str]:
    impl: Implementation = config._decodespec_impl
    lines = [f"decodespec implementation under test: {impl.name} ({impl.version})"]
    if impl.import_error:
        lines.append(f"  {impl.name} could not be imported: {impl.import_error}")
    if impl.missing:
        how = "skipped" if impl.explicit else "run as a self-check of the spec"
        lines.append(f"  missing operations ({how}): {', '.join(impl.missing)}")
    for feature, reason in impl.unsupported.items():
        lines.append(f"  unsupported feature {feature}: {reason}")
    return lines


@pytest.fixture(scope="session")
def live_server():
    """A live `decodespec serve` of the bundled model, named "smollm2", on a free
    127.0.0.1 port (`tests/serve/live.py`): one per session, shared by the server's
    tests and the Serve page's examples; loaded only when a test asks for it.

    In float32, not the file's own int4 that `decodespec serve` loads by default: the
    tests compare answers across batches (a request beside its twin), which only
    float32's near-exact agreement makes stable outside batch-invariant mode; the
    default server is tested by tests/serve/test_default_path.py."""
    from tests.serve.live import LiveServer

    with LiveServer(weights="float32") as server:
        yield server


@pytest.fixture(scope="session")
def impl(pytestconfig: pytest.Config) -> Implementation:
    return pytestconfig._decodespec_impl


def _read_xfails(path: str) -> dict[str, str]:
    entries: dict[str, str] = {}
    for line in Path(path).read_text().splitlines():
        test_id, _, reason = line.partition("#")
        if test_id.strip():
            entries[test_id.strip()] = reason.strip() or "listed in the xfails file"
    return entries


def xfail_clause(reason: str) -> str | None:
    """The clause id an xfails reason starts with (`SAMPLE-TOPK-2: ...`), if any."""
    head, colon, _ = reason.partition(":")
    return head.strip() if colon and head.strip() in registry.clauses() else None


def _xfail_reason(item: pytest.Item, xfails: dict[str, str]) -> str | None:
    reason = xfails.get(item.nodeid, xfails.get(item.nodeid.split("[")[0]))
    if reason is None:
        return None
    clause = xfail_clause(reason)
    marked = [c for marker in item.iter_markers("clause") for c in marker.args]
    if clause is not None and clause not in marked:
        raise pytest.UsageError(
            f"xfails: {item.nodeid} is listed as failing on {clause}, but it marks only {marked}"
        )
    return reason


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    path = _option(config, "xfails")
    if path:
        xfails = _read_xfails(path)
        for item in items:
            reason = _xfail_reason(item, xfails)
            if reason is not None:
                item.add_marker(pytest.mark.xfail(reason=reason, strict=False))
    known = registry.clauses()
    for item in items:
        for marker in item.iter_markers("clause"):
            unknown = [c for c in marker.args if c not in known]
            if unknown:
                raise pytest.UsageError(f"{item.nodeid} names unknown clauses {unknown}")
        unknown = [f for f in _boundaries(item) if f not in BOUNDARY_FAMILIES]
        if unknown:
            raise pytest.UsageError(f"{item.nodeid} names unknown boundary families {unknown}")


def _boundaries(item: pytest.Item) -> list[str]:
    """The boundary families a test draws (its `boundary` markers), in order."""
    return list(dict.fromkeys(f for marker in item.iter_markers("boundary") for f in marker.args))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    if report.when == "call" and report.failed and repro.last_calls():
        report.sections.append(("reproduction", "\n\n".join(repro.last_calls())))


@pytest.fixture(autouse=True)
def _clear_reproductions():
    repro.clear()
    yield


def _outcome_message(report: pytest.TestReport) -> str | None:
    """One line on why a test did not pass: the xfail or skip reason, or the error."""
    if hasattr(report, "wasxfail"):
        return report.wasxfail.removeprefix("reason: ") or None
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2]).removeprefix("Skipped: ")
    if report.failed:
        crash = getattr(report.longrepr, "reprcrash", None)
        text = crash.message if crash is not None else str(report.longrepr)
        return text.strip().splitlines()[0][:300] if text.strip() else None
    return None


class ClauseReport:
    """Collects test outcomes and writes clause -> tests -> outcome as JSON."""

    def __init__(self, path: str, impl: Implementation) -> None:
        self.path = path
        self.impl = impl
        self.outcomes: dict[str, str] = {}
        self.messages: dict[str, str] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when == "call" or report.outcome != "passed":
            outcome = report.outcome
            if hasattr(report, "wasxfail"):
                outcome = "xfailed" if report.skipped else "xpassed"
            self.outcomes.setdefault(report.nodeid, outcome)
            if outcome == "failed":  # a teardown error after a pass still fails the test
                self.outcomes[report.nodeid] = outcome
            message = _outcome_message(report)
            if message and report.nodeid not in self.messages:
                self.messages[report.nodeid] = message

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        table = {
            clause.id: {"text": clause.text, "module": clause.module, "tests": [], "boundaries": []}
            for clause in registry.clauses().values()
        }
        for item in session.items:
            ids = [c for marker in item.iter_markers("clause") for c in marker.args]
            for clause_id in dict.fromkeys(ids):
                outcome = self.outcomes.get(item.nodeid, "not run")
                entry = {"nodeid": item.nodeid, "outcome": outcome}
                if item.nodeid in self.messages:
                    entry["message"] = self.messages[item.nodeid]
                if _boundaries(item):
                    entry["boundaries"] = _boundaries(item)
                table[clause_id]["tests"].append(entry)
                drawn = table[clause_id]["boundaries"]
                drawn += [f for f in _boundaries(item) if f not in drawn]
        impl = self.impl
        report = {
            "implementation": {"name": impl.name, "version": impl.version},
            "missing_operations": impl.missing,
            "self_checked_operations": [] if impl.explicit else impl.missing,
            "unsupported_features": impl.unsupported,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "platform": {
                "python": platform.python_version(),
                "torch": torch.__version__,
                "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            },
            "exit_status": int(exitstatus),
            "boundary_families": BOUNDARY_FAMILIES,
            "clauses": table,
        }
        Path(self.path).write_text(json.dumps(report, indent=2) + "\n")
