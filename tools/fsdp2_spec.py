"""PyTorch's own FSDP2 unit tests, run against FSDP2 or against raggedfsdp (issue 21, item 6).

    python tools/fsdp2_spec.py --tests DIR --impl torch      --out fsdp2-spec-torch.json
    python tools/fsdp2_spec.py --tests DIR --impl raggedfsdp --out fsdp2-spec-raggedfsdp.json
    python tools/fsdp2_spec.py --compare fsdp2-spec-torch.json fsdp2-spec-raggedfsdp.json

DIR holds PyTorch's ``test/distributed/_composable/fsdp/test_*.py`` (and the helpers they import),
fetched from PyTorch's repository and kept outside ours. An optional ``DIR/COMMITS.tsv`` (``file
<TAB> commit``) is copied into the JSON so a result names the versions it ran.

What runs. Every ``test_*`` method of every ``unittest.TestCase`` in every ``DIR/test_*.py``, in
file order, one worker process per file and one test at a time, each under ``--timeout`` seconds
(a test past it is killed with its worker, recorded as ``timeout``, and the worker restarts at the
next test). torch's own skips decide what runs on a CPU: ``skip_if_lt_x_gpu`` and the like skip
CUDA-only tests exactly as in PyTorch's CI. Both kinds of CPU test run: ``FSDPTestMultiThread``
(ranks are threads over torch's threaded process group) and ``FSDPTest`` (ranks are spawned
processes over Gloo, one per rank, ``world_size`` of them).

What ``--impl raggedfsdp`` swaps, before any test module is imported (and again in every rank
that ``FSDPTest`` or ``FSDPTestContinuous`` spawns, which re-imports this file as ``__mp_main__``):

- ``fully_shard`` -> ``raggedfsdp.fully_shard``, wherever a test can bind it:
  ``torch.distributed.fsdp``, ``torch.distributed.fsdp._fully_shard`` and its ``_fully_shard``
  module, the old path ``torch.distributed._composable.fsdp`` (and its ``fully_shard`` module),
  and ``torch.testing._internal.common_fsdp`` (whose helpers, e.g. ``MLPStack.parallelize``, and
  ``compiled_fsdp_test`` call it);
- ``FSDPModule`` -> ``raggedfsdp.FSDPModule`` in the same modules, but only while raggedfsdp's
  class is not a subclass of torch's (then ``isinstance(m, FSDPModule)`` in a test asks about
  raggedfsdp's modules); once it is one, torch's class is kept and this swap is not made.

Everything else is kept: the test bodies are not edited; torch's ``MixedPrecisionPolicy``,
``OffloadPolicy``, ``DTensor``, ``DeviceMesh``, ``replicate`` (the reference models),
``register_fsdp_forward_method`` (routed to raggedfsdp's own: the swap installs raggedfsdp's
changes to torch first, ``raggedfsdp.integration.install()``) and torch's
FSDP2 internals a test imports (``_fsdp_param_group``, ``FSDPParamGroup`` patches, ...) stay
torch's, so a test that reads them fails, and says so. The JSON's ``swapped`` lists what was
swapped in that run.

Repairs to PyTorch's test harness (``torch.testing._internal``), made for both impls and
listed in the JSON's ``harness``; none touches a test body:

- torch 2.13's ``FSDPTest._run`` exits every rank as skipped when ``torch.accelerator`` counts
  fewer devices than ranks, so on a CPU machine every multi-process test is skipped; the
  ``FSDPTestMixin._run`` it copies is the same but for ``DEVICE_TYPE != "cpu" and`` in that
  check. The copy is removed, so the mixin's runs (only when the two differ exactly so).
- ``FSDPTestContinuous._init_pg`` has the same check and no twin: on CPU it is replaced by the
  rest of it (torch's base ``_init_pg``; the lines left out only pick a CUDA/XPU device).
- names a newer test file imports from ``torch.testing._internal`` that the installed torch does
  not have yet (markers such as ``HardwareClassification``) are given a stand-in, only where
  absent.

Outcomes: ``pass``, ``fail`` (an ``AssertionError``, in any rank), ``error`` (any other
exception; a module that cannot be imported is one ``error`` entry named after the module),
``skip`` and ``timeout``. ``message`` is the first line of the innermost raised exception of
the first failing rank, ``detail`` the lines after it, ``where`` the deepest frame in a test file
(``file:line: code``). ``kind``: ``thread`` (FSDPTestMultiThread), ``process`` (FSDPTest,
FSDPTestContinuous and other multi-process cases) or ``plain``. A multi-process test whose
``world_size`` is 0 (CUDA's device count, on a CPU machine) spawns no ranks and would pass
vacuously: it is a ``skip`` here. After a failure, a ``MultiProcContinuousTest`` class gets fresh
ranks for its next test (torch's skips the rest of the class), so each test has its own verdict.

``--logs DIR`` keeps what each worker and its ranks print. Needs ``expecttest`` (torch's test
utilities import it): ``pip install expecttest``. Runs are one thread per process
(``OMP_NUM_THREADS=1``).
"""

from __future__ import annotations

import argparse
import contextlib
import enum
import hashlib
import importlib
import inspect
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import types
import unittest
from collections.abc import Iterator
from pathlib import Path
from typing import Any

IMPL_ENV = "FSDP2_SPEC_IMPL"  # set in workers (and inherited by the ranks they spawn)
SWAP_MODULES = (
    "torch.distributed.fsdp",
    "torch.distributed.fsdp._fully_shard",
    "torch.distributed.fsdp._fully_shard._fully_shard",
    "torch.distributed._composable.fsdp",
    "torch.distributed._composable.fsdp.fully_shard",
    "torch.testing._internal.common_fsdp",
)
# Stand-ins for test-harness names that newer test files import and torch 2.13 lacks.
_STAND_INS: dict[tuple[str, str], Any] = {
    ("torch.testing._internal.common_utils", "HardwareClassification"): enum.Enum(
        "HardwareClassification", ["GENERIC", "CUDA", "CPU"]
    ),
}
_EXCEPTION_LINE = re.compile(r"^([A-Za-z_][\w.]*)(: .*)?$")
_TEST_FRAME = re.compile(r'File "(?:.*/)?(test_[^"/]+\.py)", line (\d+)')
_RANK_BLOCK = re.compile(r"^(Thread|Process) \d+ (exited|terminated)", re.MULTILINE)


# ---------------------------------------------------------------- the swap (worker and ranks)


def install(impl: str) -> dict[str, list[str]]:
    """Repairs torch's test harness and, for ``raggedfsdp``, swaps ``fully_shard`` in."""
    harness = _repair_harness()
    swapped = _swap_in_raggedfsdp() if impl == "raggedfsdp" else []
    return {"harness": harness, "swapped": swapped}


def _repair_harness() -> list[str]:
    repaired = []
    for (module_name, name), value in _STAND_INS.items():
        module = importlib.import_module(module_name)
        if not hasattr(module, name):
            setattr(module, name, value)
            repaired.append(f"stand-in {module_name}.{name}")
    from torch.testing._internal import common_fsdp

    if common_fsdp.DEVICE_TYPE != "cpu":
        return repaired
    own, mixin = vars(common_fsdp.FSDPTest).get("_run"), vars(common_fsdp.FSDPTestMixin).get("_run")
    if own is not None and mixin is not None:
        own_src, mixin_src = (inspect.getsource(f.__func__) for f in (own, mixin))
        if own_src == mixin_src.replace('DEVICE_TYPE != "cpu" and ', ""):
            del common_fsdp.FSDPTest._run
            repaired.append("FSDPTest._run -> FSDPTestMixin._run (runs on CPU)")
    continuous = common_fsdp.FSDPTestContinuous
    check = "if torch.accelerator.device_count() < world_size:"
    if check in inspect.getsource(continuous._init_pg.__func__):

        def _init_pg(cls: type, rank: int, world_size: int, rdvz_file: str) -> None:
            os.environ["TORCH_NCCL_DESYNC_DEBUG"] = "0"  # the rest of torch's, less the check
            super(continuous, cls)._init_pg(rank, world_size, rdvz_file)

        continuous._init_pg = classmethod(_init_pg)
        repaired.append("FSDPTestContinuous._init_pg without the accelerator count (runs on CPU)")
    return repaired


def _swap_in_raggedfsdp() -> list[str]:
    import torch.distributed.fsdp as torch_fsdp

    import raggedfsdp

    # Before the test modules bind torch's functions by name: torch's
    # register_fsdp_forward_method, say, then routes raggedfsdp's modules (made on first use
    # otherwise, after those bindings).
    raggedfsdp.integration.install()
    replacements: dict[str, tuple[object, object]] = {
        "fully_shard": (torch_fsdp.fully_shard, raggedfsdp.fully_shard)
    }
    if not issubclass(raggedfsdp.FSDPModule, torch_fsdp.FSDPModule):
        replacements["FSDPModule"] = (torch_fsdp.FSDPModule, raggedfsdp.FSDPModule)
    swapped = []
    for module_name in SWAP_MODULES:
        module = importlib.import_module(module_name)
        for name, (old, new) in replacements.items():
            if getattr(module, name, None) is old:
                setattr(module, name, new)
            if getattr(module, name, None) is new:  # or bound to it already, when imported late
                swapped.append(f"{module_name}.{name}")
    return swapped


# ---------------------------------------------------------------- the worker: one file's tests


def _test_ids(module: types.ModuleType) -> Iterator[unittest.TestCase]:
    def flatten(suite: unittest.TestSuite) -> Iterator[unittest.TestCase]:
        for item in suite:
            if isinstance(item, unittest.TestSuite):
                yield from flatten(item)
            else:
                yield item

    yield from flatten(unittest.defaultTestLoader.loadTestsFromModule(module))


def _kind(test: unittest.TestCase) -> str:
    from torch.testing._internal.common_distributed import (
        MultiProcContinuousTest,
        MultiProcessTestCase,
        MultiThreadedTestCase,
    )

    if isinstance(test, MultiThreadedTestCase):
        return "thread"
    multi_process = isinstance(test, MultiProcessTestCase | MultiProcContinuousTest)
    return "process" if multi_process else "plain"


def _no_ranks(test: unittest.TestCase) -> bool:
    from torch.testing._internal.common_distributed import MultiProcessTestCase

    return isinstance(test, MultiProcessTestCase) and test.world_size < 1


def summarize(text: str) -> dict[str, str]:
    """The first failing rank's innermost exception: its first line (``message``), the lines
    after it (``detail``) and the deepest frame in a test file (``where``)."""
    blocks = [m.start() for m in _RANK_BLOCK.finditer(text)]
    if len(blocks) > 1:  # keep the first rank's report only
        text = text[blocks[0] : blocks[1]]
    lines = text.splitlines()
    if blocks:
        lines = lines[1:]  # "Thread 0 exited with exception:"
    candidates = [
        i
        for i, line in enumerate(lines)
        if line
        and not line[0].isspace()
        and _EXCEPTION_LINE.match(line)
        and not line.startswith(("Traceback", "During handling", "The above exception"))
    ]
    if not candidates:
        return {"message": (lines[0] if lines else "")[:300], "detail": "", "where": ""}
    at = candidates[-1]
    detail = []
    for line in lines[at + 1 : at + 8]:
        if not line.strip() or line.startswith("To execute this test"):
            break
        detail.append(line.strip())
    where = ""
    for i, line in enumerate(lines[:at]):
        frame = _TEST_FRAME.search(line)
        if frame and i + 1 < at:
            where = f"{frame[1]}:{frame[2]}: {lines[i + 1].strip()}"
    return {
        "message": lines[at].strip()[:300],
        "detail": " / ".join(detail)[:400],
        "where": where[:200],
    }


class _Result(unittest.TestResult):
    """One test's outcome, its subtests folded in (the first failure wins)."""

    def __init__(self) -> None:
        super().__init__()
        self.outcome, self.message, self.detail, self.where = "pass", "", "", ""

    def _failed(self, err: Any) -> None:
        if self.outcome in ("fail", "error"):
            return
        text = "".join(traceback.format_exception(*err))
        summary = summarize(text)
        self.message, self.detail, self.where = (summary[k] for k in ("message", "detail", "where"))
        exception = self.message.split(":", 1)[0]
        self.outcome = "fail" if exception.endswith("AssertionError") else "error"

    def addFailure(self, test: Any, err: Any) -> None:
        self._failed(err)

    def addError(self, test: Any, err: Any) -> None:
        self._failed(err)

    def addSubTest(self, test: Any, subtest: Any, err: Any) -> None:
        if err is not None:
            self._failed(err)

    def addSkip(self, test: Any, reason: str) -> None:
        if self.outcome == "pass":
            self.outcome, self.message = "skip", reason.splitlines()[0] if reason else ""

    def addUnexpectedSuccess(self, test: Any) -> None:
        self.outcome, self.message = "fail", "unexpected success (expectedFailure)"


def worker(path: Path, impl: str, events: Path, start: int, select: str | None) -> None:
    """Runs ``path``'s tests from index ``start``, one JSON line per event into ``events``."""

    def emit(**event: Any) -> None:
        with events.open("a") as f:
            f.write(json.dumps(event) + "\n")

    emit(event="setup", **install(impl))
    try:
        module = importlib.import_module(path.stem)
    except BaseException as exc:  # a test file torch itself cannot import on this version
        emit(
            event="import_error", message=summarize(traceback.format_exc())["message"] or repr(exc)
        )
        return
    tests = list(_test_ids(module))
    emit(event="list", ids=[t.id() for t in tests], kinds=[_kind(t) for t in tests])
    fixture: tuple[type, BaseException | None] | None = None  # the class set up, and how
    for index in range(start, len(tests)):
        test = tests[index]
        if select is not None and select not in test.id():
            continue
        if fixture is None or fixture[0] is not type(test):
            fixture = _class_fixture(fixture, type(test))
        emit(event="start", index=index, id=test.id())
        result, began = _Result(), time.perf_counter()
        if fixture[1] is None:
            test.run(result)
            if _no_ranks(test) and result.outcome == "pass":
                # MultiProcessTestCase passes a test whose world_size is 0 (CUDA's device
                # count) without running it: torch's CI counts it as a pass, this as a skip.
                result.outcome, result.message = "skip", "no ranks spawned (world_size 0)"
            if getattr(type(test), "poison_pill", False):
                # MultiProcContinuousTest skips the rest of a class after a failure; give the
                # next test fresh ranks instead, so that each test has its own verdict.
                _class_fixture(fixture, None)
                type(test).poison_pill, type(test)._processes_spawned = False, False
                fixture = _class_fixture(None, type(test))
        elif isinstance(fixture[1], unittest.SkipTest):
            result.addSkip(test, str(fixture[1]))
        else:
            result.addError(test, (type(fixture[1]), fixture[1], fixture[1].__traceback__))
        emit(
            event="result",
            index=index,
            id=test.id(),
            outcome=result.outcome,
            duration_s=round(time.perf_counter() - began, 2),
            message=result.message,
            detail=result.detail,
            where=result.where,
        )
    _class_fixture(fixture, None)
    emit(event="done")


def _class_fixture(
    previous: tuple[type, BaseException | None] | None, cls: type | None
) -> tuple[type, BaseException | None]:
    """Tears the previous class down and sets ``cls`` up, as a unittest suite would."""
    if previous is not None and previous[1] is None:
        with contextlib.suppress(Exception):
            previous[0].tearDownClass()
    if cls is None:
        return (type(None), None)
    try:
        cls.setUpClass()
    except BaseException as exc:
        return (cls, exc)
    return (cls, None)


# ---------------------------------------------------------------- the parent: files, timeouts


def _run_file(
    path: Path, impl: str, timeout: float, select: str | None, logs: Path | None
) -> dict[str, Any]:
    """Runs one file's tests in workers, restarting after a test that hangs or kills its worker."""
    state: dict[str, Any] = {"setup": {}, "results": {}, "kinds": {}, "total": None, "start": 0}
    env = dict(os.environ, OMP_NUM_THREADS="1", **{IMPL_ENV: impl})
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(path.parent), env.get("PYTHONPATH")]))
    with tempfile.TemporaryDirectory() as tmp:
        while state["total"] is None or state["start"] < state["total"]:
            events = Path(tmp) / f"events-{state['start']}.jsonl"
            command = [sys.executable, __file__, "--worker", str(path), "--impl", impl]
            command += ["--events", str(events), "--start", str(state["start"])]
            command += ["-k", select] if select else []
            log = (logs / f"{impl}-{path.stem}-{state['start']}.log") if logs else None
            with open(log or os.devnull, "w") as out:
                proc = subprocess.Popen(
                    command,
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # so that a timeout kills the ranks it spawned too
                )
                _watch(proc, events, state, path.stem, timeout)
                _kill(proc)
    return {"setup": state["setup"], "results": list(state["results"].values())}


def _watch(
    proc: subprocess.Popen, events: Path, state: dict[str, Any], stem: str, timeout: float
) -> None:
    """Follows one worker's events until it is done, dies, or its current test times out."""
    results, kinds = state["results"], state["kinds"]
    current: tuple[int, str, float] | None = None  # (index, id, monotonic start)
    seen = 0
    while True:
        time.sleep(0.2)
        exited = proc.poll() is not None  # read the events after this, so none is missed
        lines = events.read_text().splitlines() if events.exists() else []
        for event in map(json.loads, lines[seen:]):
            name = event["event"]
            if name == "setup":
                state["setup"] = {k: event[k] for k in ("harness", "swapped")}
            elif name == "import_error":
                results[stem] = _entry(stem, "import", "error", 0.0, event["message"])
                state["total"] = 0
            elif name == "list":
                state["total"] = len(event["ids"])
                kinds.update(zip(event["ids"], event["kinds"], strict=True))
            elif name == "start":
                current = (event["index"], event["id"], time.monotonic())
            elif name == "result":
                test_id = event["id"]
                results[test_id] = _entry(
                    test_id,
                    kinds[test_id],
                    event["outcome"],
                    event["duration_s"],
                    event["message"],
                    detail=event["detail"],
                    where=event["where"],
                )
                _progress(results[test_id])
                state["start"], current = event["index"] + 1, None
            elif name == "done":
                state["start"] = state["total"]
                return
        seen = len(lines)
        timed_out = current is not None and time.monotonic() - current[2] > timeout
        if not (timed_out or exited):
            continue
        if state["total"] is None:  # it died before it listed its tests
            message = f"worker exited with code {proc.returncode} before listing the tests"
            results[stem] = _entry(stem, "import", "error", 0.0, message)
            state["total"] = 0
            return
        # Blame the test under way (or the next one: it died in a class fixture), go on after it.
        index = current[0] if current is not None else state["start"]
        if index < state["total"]:
            test_id = list(kinds)[index]
            elapsed = time.monotonic() - current[2] if current is not None else 0.0
            if timed_out:
                outcome, message = "timeout", f"no result within {timeout:.0f} s (killed)"
            else:
                outcome, message = "error", f"worker exited with code {proc.returncode} in it"
            results[test_id] = _entry(test_id, kinds[test_id], outcome, elapsed, message)
            _progress(results[test_id])
        state["start"] = index + 1
        return


def _progress(entry: dict) -> None:
    line = f"  {entry['outcome']:8} {entry['duration_s']:7.1f}s {entry['id']}"
    print(line + (f"  {entry['message'][:80]}" if entry["message"] else ""), file=sys.stderr)


def _entry(
    test_id: str, kind: str, outcome: str, duration: float, message: str, **more: str
) -> dict:
    return {
        "id": test_id,
        "kind": kind,
        "outcome": outcome,
        "duration_s": round(duration, 2),
        "message": message,
        **more,
    }


def _kill(proc: subprocess.Popen) -> None:
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)  # a Gloo worker may linger at exit
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)  # and the ranks it spawned
    proc.wait()


def run(
    tests_dir: Path, impl: str, timeout: float, files: str, select: str | None, logs: Path | None
) -> dict:
    import torch

    began = time.monotonic()
    out: dict[str, Any] = {
        "impl": impl,
        "torch": torch.__version__,
        "torch_git": torch.version.git_version,
        "raggedfsdp": _raggedfsdp_version(),
        "tests_dir": str(tests_dir),
        "timeout_s": timeout,
        "files": {},
        "results": [],
    }
    commits = tests_dir / "COMMITS.tsv"
    if commits.exists():
        rows = (line.split("\t") for line in commits.read_text().splitlines() if "\t" in line)
        out["commits"] = {name: commit for name, commit in rows}
    for path in sorted(tests_dir.glob(files)):
        print(f"{impl}: {path.name}", file=sys.stderr, flush=True)
        done = _run_file(path, impl, timeout, select, logs)
        out.update(done["setup"])
        digest = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
        out["files"][path.name] = {"sha256_16": digest}
        for entry in done["results"]:
            entry["file"] = path.name
            out["results"].append(entry)
    out["wall_s"] = round(time.monotonic() - began, 1)
    return out


def _raggedfsdp_version() -> str:
    """The commit of the raggedfsdp that runs (its checkout), ``-dirty`` if it has changes."""
    import raggedfsdp

    here = Path(raggedfsdp.__file__).resolve().parent
    git = subprocess.run(
        ["git", "-C", str(here), "describe", "--always", "--dirty"],
        capture_output=True,
        text=True,
    )
    return git.stdout.strip() or "unknown"


# ---------------------------------------------------------------- the comparison


def counts(results: list[dict]) -> dict[str, dict[str, int]]:
    table: dict[str, dict[str, int]] = {}
    for entry in results:
        row = table.setdefault(entry["kind"], {})
        row[entry["outcome"]] = row.get(entry["outcome"], 0) + 1
    return table


# A first guess at why raggedfsdp fails a test FSDP2 passes, from the first error line; the
# report in docs/results/ checks each by hand. First match wins.
CAUSES: tuple[tuple[str, str], ...] = (
    ("refused on purpose: a list of modules (one group)", r"takes one nn.Module"),
    ("refused on purpose: Shard(d>0)", r"shard_placement_fn asked"),
    ("refused on purpose: int reshard_after_forward", r"reshard_after_forward=\d|int reshard"),
    (
        "reads an FSDP2 internal (fully_shard.state, _get_fsdp_state, managed modules, ...)",
        r"has no attribute '(state|_get_fsdp_state|_fsdp_param_group|_lazy_init|_set_\w+)'"
        r"|managed_(modules|states|params)|_get_fsdp_state\(\) is not supported"
        r"|'TorchFacingState' object has no attribute",
    ),
    ("counts FSDP2's ops (CommDebugMode, dispatch)", r"_count\b|comm_counts|len\(divisions\)"),
    (
        "parameters are not DTensors",
        r"DTensor|to_local|full_tensor|placements|_local_tensor|_spec\b|device_mesh"
        r"|Dimension out of range",
    ),
    ("fully_shard over a sub-mesh of the world", r"must cover every rank"),
    (
        "refuses too, with another exception or message",
        r"does not match|already sharded"
        r"|not contiguous|sharded already",
    ),
    ("FSDP2 refuses, raggedfsdp accepts", r"not raised"),
    (
        "compares local pieces of two unit groupings (ragged pieces follow the unit's plan)",
        r"attribute 'shape' do not match",
    ),
)


def cause_of(entry: dict) -> str:
    text = " ".join(entry.get(k, "") for k in ("message", "detail", "where"))
    for cause, pattern in CAUSES:
        if re.search(pattern, text):
            return cause
    return "unclassified"


def compare(reference: dict, candidate: dict) -> str:
    """Markdown: counts, and every test the reference passes that the candidate does not."""
    ref = {e["id"]: e for e in reference["results"]}
    cand = {e["id"]: e for e in candidate["results"]}
    lines = [
        "| kind | FSDP2 passes | raggedfsdp passes of those | FSDP2 skips | FSDP2 fails |",
        "| --- | --- | --- | --- | --- |",
    ]
    for kind in ("thread", "process", "plain", "import"):
        of_kind = [e for e in ref.values() if e["kind"] == kind]
        if not of_kind:
            continue
        passed = [e["id"] for e in of_kind if e["outcome"] == "pass"]
        both = [i for i in passed if cand.get(i, {}).get("outcome") == "pass"]
        skipped = sum(e["outcome"] == "skip" for e in of_kind)
        lines.append(
            f"| {kind} | {len(passed)} | {len(both)} | {skipped} | "
            f"{len(of_kind) - len(passed) - skipped} |"
        )
    by_cause: dict[str, list[str]] = {}
    for test_id, entry in ref.items():
        other = cand.get(test_id, {"outcome": "missing", "message": ""})
        if entry["outcome"] == "pass" and other["outcome"] != "pass":
            message = other["message"].replace("|", "\\|")
            row = f"| `{test_id}` | {other['outcome']} | {message} |"
            by_cause.setdefault(cause_of(other), []).append(row)
    for cause, rows in by_cause.items():
        lines += ["", f"**{cause}** ({len(rows)})", "", "| test | raggedfsdp | first error line |"]
        lines += ["| --- | --- | --- |", *rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--tests", type=Path, help="folder of PyTorch's FSDP2 test files")
    parser.add_argument("--impl", choices=("torch", "raggedfsdp"), default="torch")
    parser.add_argument("--out", type=Path, help="where to write the JSON (default: stdout)")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per test")
    parser.add_argument("--files", default="test_*.py", help="glob of test files in --tests")
    parser.add_argument("-k", dest="select", help="only tests whose id contains this")
    parser.add_argument("--logs", type=Path, help="keep each worker's output in this folder")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("TORCH_JSON", "RF_JSON"))
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--events", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--start", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        worker(args.worker, args.impl, args.events, args.start, args.select)
        return 0
    if args.compare is not None:
        reference, candidate = (json.loads(p.read_text()) for p in args.compare)
        print(compare(reference, candidate))
        return 0
    if args.tests is None:
        parser.error("--tests DIR is required")
    if args.logs is not None:
        args.logs.mkdir(parents=True, exist_ok=True)
    tests = args.tests.resolve()
    result = run(tests, args.impl, args.timeout, args.files, args.select, args.logs)
    text = json.dumps(result, indent=1)
    if args.out is None:
        print(text)
    else:
        args.out.write_text(text + "\n")
    print(json.dumps(counts(result["results"])), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
elif __name__ == "__mp_main__" and os.environ.get(IMPL_ENV):
    # A rank that FSDPTest spawned: it re-imports this file before it unpickles its test, so
    # the swap is in place before the test module binds ``fully_shard``.
    install(os.environ[IMPL_ENV])
