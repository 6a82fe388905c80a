"""Mutation testing of tfmp's core packages: do the tests fail when tfmp breaks?

Enumerates classic mutants in the modules of four packages of ``tfmp/_src``
(loss_scale, policy, attachment, keras_hooks), draws a seeded random sample per
package, and for each mutant writes the mutated module into a clone of the
repository, runs the package's covering test files there (`COVERING_TESTS`),
and restores the module. A mutant is *killed* when a test fails (the first
failing test is recorded, pytest runs with ``-x``), *timeout* when the tests
hang past the limit (counted as killed: a hang is an observable change), and
*survived* when every test passes. The result is a JSON file and a markdown
table of kill rates per package with 95% Clopper-Pearson intervals (the
mutants are a sample).

Never point ``--tree`` at a working tree others use: the script writes into it.
Usage (from a clone, e.g. ``git clone -q /work/main /tmp/mut-tree``)::

    python scripts/mutation.py --tree /tmp/mut-tree --sample 25
    python scripts/mutation.py --tree /tmp/mut-tree --list --package policy
    python scripts/mutation.py --tree /tmp/mut-tree --tree /tmp/mut-tree2 --sample 25
    python scripts/mutation.py --tree /tmp/mut-tree --only tfmp/_src/policy/policy.py:245:Lt->LtE \\
        --tests tests/test_policy.py

Each mutant is a pytest subprocess that imports TensorFlow; ``--tree`` given
twice (two clones) runs two mutants at a time, one per clone. ``--tests``
replaces the covering tests, to check that a given test kills a survivor.
The sample is drawn from the enumeration: changing the operators, the skip
rules or the modules changes which mutants a seed draws.
"""

from __future__ import annotations

import argparse
import ast
import copy
import dataclasses
import datetime
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterator, Sequence

#: The packages mutated, under ``tfmp/_src``.
PACKAGES: tuple[str, ...] = ("loss_scale", "policy", "attachment", "keras_hooks")

#: Package -> the test files that exercise it, quickest and most direct first (pytest
#: runs them in this order and stops at the first failure).
COVERING_TESTS: dict[str, tuple[str, ...]] = {
    "loss_scale": (
        "tests/test_loss_scale.py",
        "tests/test_user_settings.py",
        "tests/test_custom_loop_scaling.py",
        "tests/test_saved_form.py",
        "tests/test_fused_update.py",
        "tests/test_loss_scale_guard.py",
        "tests/test_loss_scale_training.py",
    ),
    "policy": (
        "tests/test_policy.py",
        "tests/test_hardware.py",
        "tests/test_speed_probe.py",
        "tests/test_enable.py",
        "tests/test_speedups.py",
        "tests/test_float16_fusion.py",
        "tests/test_fused_update.py",  # policy/fused_update.py
    ),
    "attachment": (
        "tests/test_attachment.py",
        "tests/test_compile_line.py",
        "tests/test_enable.py",
        "tests/test_speedups.py",  # the speed switches' effect on the attachment (remapper)
    ),
    "keras_hooks": (
        "tests/test_keras_hooks.py",
        "tests/test_attachment.py",
        "tests/test_enable.py",
        "tests/test_loss_scale.py",
        "tests/test_fused_update.py",
        "tests/test_multi_worker_fit.py",  # multi_worker: only a multi-worker cluster reaches it
    ),
}

PYTEST_ARGS: tuple[str, ...] = ("-x", "-q", "-rfE", "-p", "no:cacheprovider", "-p", "no:xdist")

#: Comparison operators and the one each is flipped to.
COMPARE_FLIPS: dict[type, type] = {
    ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt,
    ast.Eq: ast.NotEq, ast.NotEq: ast.Eq, ast.Is: ast.IsNot, ast.IsNot: ast.Is,
    ast.In: ast.NotIn, ast.NotIn: ast.In,
}
#: Arithmetic operators and their swaps.
BINOP_SWAPS: dict[type, type] = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult}
#: Calls whose arguments are text and whose statements are not mutated at all.
LOGGING_RECEIVERS: frozenset[str] = frozenset({"logging", "logger", "_LOG", "log", "_logger"})
#: Functions whose bodies are not mutated: their output is text for people.
SKIPPED_FUNCTIONS: frozenset[str] = frozenset({"__repr__", "__str__"})
DEFAULT_SEED = 20261206


@dataclasses.dataclass(frozen=True)
class Mutant:
    """One mutation of one module: the node at `path` (indices into the AST) changed by `op`.

    `ident` is ``file:line:op`` (``#k`` appended for the k-th identical one on a line).
    """

    package: str
    file: str
    line: int
    op: str
    node_path: tuple
    ident: str


@dataclasses.dataclass
class Outcome:
    """What the tests did with one mutant."""

    ident: str
    package: str
    status: str  # "killed", "survived", "timeout", "invalid"
    killed_by: str | None
    seconds: float
    original: str
    mutated: str


# ---------------------------------------------------------------- enumeration


def _is_docstring(stmt: ast.stmt) -> bool:
    return isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) and isinstance(stmt.value.value, str)


def _is_text_call(node: ast.AST) -> bool:
    """A logging call (``_LOG.warning(...)``, ``logging.info(...)``): its arguments are text."""
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    return isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id in LOGGING_RECEIVERS


def _is_warn_call(node: ast.AST) -> bool:
    func = node.func if isinstance(node, ast.Call) else None
    return (isinstance(func, ast.Attribute) and func.attr == "warn") or (isinstance(func, ast.Name) and func.id == "warn")


def _is_string(node: ast.AST) -> bool:
    return isinstance(node, ast.JoinedStr) or (isinstance(node, ast.Constant) and isinstance(node.value, str))


def _is_type_checking(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _skipped_fields(node: ast.AST) -> set[str]:
    """The fields of `node` that hold annotations or text, never mutated."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return {"returns"}
    if isinstance(node, ast.arg):
        return {"annotation"}
    if isinstance(node, ast.AnnAssign):
        return {"annotation"}
    return set()


def _node_mutations(node: ast.AST, parent_is_block: bool) -> list[str]:
    """The mutation operators that apply to `node` itself (not its children)."""
    ops: list[str] = []
    if isinstance(node, ast.Compare):
        for i, op in enumerate(node.ops):
            flip = COMPARE_FLIPS.get(type(op))
            if flip is not None:
                ops.append(f"{type(op).__name__}->{flip.__name__}" + (f"@{i}" if len(node.ops) > 1 else ""))
    elif isinstance(node, ast.BoolOp):
        ops.append("and->or" if isinstance(node.op, ast.And) else "or->and")
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        ops.append("not-drop")
    elif isinstance(node, ast.Constant) and isinstance(node.value, bool):
        ops.append(f"{node.value}->{not node.value}")
    elif isinstance(node, ast.Constant) and type(node.value) in (int, float):
        ops.append(f"num:{node.value!r}->{_changed_number(node.value)!r}")
    elif isinstance(node, (ast.BinOp, ast.AugAssign)) and type(node.op) in BINOP_SWAPS:
        operands = (node.left, node.right) if isinstance(node, ast.BinOp) else (node.value,)
        if not any(_is_string(o) for o in operands):
            ops.append(f"{type(node.op).__name__}->{BINOP_SWAPS[type(node.op)].__name__}")
    if parent_is_block:
        ops.extend(_statement_mutations(node))
    return ops


def _statement_mutations(node: ast.AST) -> list[str]:
    """``stmt->pass`` for an assignment or a call statement, ``return->None`` for ``return x``."""
    if isinstance(node, ast.Return) and node.value is not None and not (
            isinstance(node.value, ast.Constant) and node.value.value is None):
        return ["return->None"]
    if isinstance(node, (ast.Assign, ast.AugAssign)) or (isinstance(node, ast.AnnAssign) and node.value is not None):
        return ["stmt->pass"]
    if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call) and not _is_text_call(node.value):
        return ["stmt->pass"]
    return []


def _changed_number(value: int | float) -> int | float:
    """The constant a numeric mutant puts in place of `value`."""
    if isinstance(value, int):
        return value + 1
    return 1.0 if value == 0.0 else value * 2


def _walk_mutable(node: ast.AST, path: tuple, parent_is_block: bool) -> Iterator[tuple[ast.AST, tuple, str]]:
    """Yields (node, path, op) for every mutation in `node`'s subtree, skipping text and annotations."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in SKIPPED_FUNCTIONS:
        return
    if isinstance(node, (ast.Raise, ast.JoinedStr)) or _is_text_call(node) or _is_type_checking(node):
        return
    if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
        return
    for op in _node_mutations(node, parent_is_block):
        yield node, path, op
    if _is_warn_call(node):
        return  # its arguments are the warning's text and category
    skipped = _skipped_fields(node)
    for field, value in ast.iter_fields(node):
        if field in skipped:
            continue
        if isinstance(value, list):
            is_block = field in ("body", "orelse", "finalbody")
            for i, child in enumerate(value):
                if isinstance(child, ast.AST) and not (is_block and i == 0 and _is_docstring(child)):
                    yield from _walk_mutable(child, path + ((field, i),), is_block)
        elif isinstance(value, ast.AST):
            yield from _walk_mutable(value, path + ((field, None),), False)


def _module_files(root: Path, package: str) -> list[Path]:
    return sorted(p for p in (root / "tfmp" / "_src" / package).glob("*.py") if p.name != "__init__.py")


def enumerate_mutants(root: Path, package: str) -> list[Mutant]:
    """Every mutant of the modules of `package` that compiles, in file and line order, with unique idents."""
    mutants: list[Mutant] = []
    for file in _module_files(root, package):
        rel = file.relative_to(root).as_posix()
        source = file.read_text()
        tree = ast.parse(source)
        seen: dict[str, int] = {}
        for node, path, op in _walk_mutable(tree, (), False):
            base = f"{rel}:{node.lineno}:{op}"
            seen[base] = seen.get(base, 0) + 1
            ident = base if seen[base] == 1 else f"{base}#{seen[base]}"
            mutant = Mutant(package, rel, node.lineno, op, path, ident)
            if _compiles(source, mutant):
                mutants.append(mutant)
    return mutants


def _compiles(source: str, mutant: Mutant) -> bool:
    """False for a mutant Python rejects (``pass`` in place of the only binding of a ``nonlocal``)."""
    try:
        mutate_source(source, mutant)
    except SyntaxError:
        return False
    return True


def sample_mutants(mutants: Sequence[Mutant], size: int, seed: int, package: str) -> list[Mutant]:
    """A seeded random sample of `size` mutants (all of them when fewer), in enumeration order."""
    rng = random.Random(f"{seed}:{package}")
    chosen = rng.sample(range(len(mutants)), min(size, len(mutants)))
    return [mutants[i] for i in sorted(chosen)]


# ---------------------------------------------------------------- mutation


def _resolve(tree: ast.AST, path: tuple) -> tuple[ast.AST, ast.AST, str, int | None]:
    """The node at `path` with its parent, the parent's field and the index in it."""
    parent, node, field, index = None, tree, "", None
    for field, index in path:
        parent = node
        value = getattr(node, field)
        node = value[index] if index is not None else value
    return node, parent, field, index


def _mutated_node(node: ast.AST, op: str) -> ast.AST:
    """A changed copy of `node` for operator `op`."""
    new = copy.deepcopy(node)
    if op == "return->None":
        new.value = None
    elif op == "stmt->pass":
        new = ast.Pass()
    elif isinstance(new, ast.Compare):
        i = int(op.split("@")[1]) if "@" in op else 0
        new.ops[i] = COMPARE_FLIPS[type(new.ops[i])]()
    elif isinstance(new, ast.BoolOp):
        new.op = ast.Or() if isinstance(new.op, ast.And) else ast.And()
    elif op == "not-drop":
        new = new.operand
    elif isinstance(new, ast.Constant) and isinstance(new.value, bool):
        new.value = not new.value
    elif isinstance(new, ast.Constant):
        new.value = _changed_number(new.value)
    elif isinstance(new, (ast.BinOp, ast.AugAssign)):
        new.op = BINOP_SWAPS[type(new.op)]()
    else:
        raise ValueError(f"no mutation {op} for {type(node).__name__}")
    return new


def mutate_source(source: str, mutant: Mutant) -> tuple[str, str, str]:
    """The module's source with `mutant` applied, and the original and new text of the node.

    Only the node's own span is rewritten (``ast.unparse`` of the changed node,
    parenthesized when it is an expression), so the rest of the file, comments
    and line numbers included, stays as it was.
    """
    tree = ast.parse(source)
    node, _, _, _ = _resolve(tree, mutant.node_path)
    new = _mutated_node(node, mutant.op)
    new_text = ast.unparse(new)
    if isinstance(node, ast.expr):
        new_text = f"({new_text})"
    lines = source.splitlines(keepends=True)
    offsets = [0]
    for line in lines:
        offsets.append(offsets[-1] + len(line.encode()))
    raw = source.encode()
    start = offsets[node.lineno - 1] + node.col_offset
    end = offsets[node.end_lineno - 1] + node.end_col_offset
    original = raw[start:end].decode()
    mutated = (raw[:start] + new_text.encode() + raw[end:]).decode()
    compile(mutated, mutant.file, "exec")
    return mutated, original, new_text


# ---------------------------------------------------------------- running tests


def _test_env(tree: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(tree)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return env


def _drop_bytecode(module: Path) -> None:
    """Removes `module`'s cached bytecode, so the next import compiles the file as it is now."""
    for pyc in (module.parent / "__pycache__").glob(f"{module.stem}.*.pyc"):
        pyc.unlink(missing_ok=True)


def run_tests(tree: Path, tests: Sequence[str], timeout: float, python: str) -> tuple[str, str | None, float, str]:
    """Runs `tests` in `tree`: ("passed" | "failed" | "timeout", first failing test, seconds, output tail)."""
    command = ["nice", "-n", "10", python, "-m", "pytest", *PYTEST_ARGS, *tests]
    start = time.monotonic()
    process = subprocess.Popen(command, cwd=tree, env=_test_env(tree), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        return "timeout", None, time.monotonic() - start, output[-3000:]
    seconds = time.monotonic() - start
    if process.returncode == 0:
        return "passed", None, seconds, output[-3000:]
    return "failed", _first_failure(output), seconds, output[-3000:]


def _first_failure(output: str) -> str:
    """The first ``FAILED``/``ERROR`` node id of pytest's short summary (or why none is there)."""
    match = re.search(r"^(?:FAILED|ERROR) (\S+)", output, re.MULTILINE)
    if match:
        return match.group(1)
    return "pytest exit without a failed test: " + (output.strip().splitlines() or ["(no output)"])[-1]


def check_tree(tree: Path, python: str) -> None:
    """Fails unless `tree`'s tfmp is the one a subprocess in it imports."""
    found = subprocess.run([python, "-c", "import tfmp, sys; sys.stdout.write(tfmp.__file__)"], cwd=tree,
                           env=_test_env(tree), capture_output=True, text=True, check=True).stdout
    if not Path(found).resolve().is_relative_to(tree.resolve()):
        raise SystemExit(f"{tree}: imports tfmp from {found}, not from the tree")


def run_mutant(tree: Path, mutant: Mutant, timeout: float, python: str,
               tests: Sequence[str] | None = None) -> Outcome:
    """Writes `mutant` into `tree`, runs `tests` (default: its package's covering tests), restores the module."""
    module = tree / mutant.file
    source = module.read_text()
    try:
        mutated, original, new_text = mutate_source(source, mutant)
    except (SyntaxError, ValueError) as error:
        return Outcome(mutant.ident, mutant.package, "invalid", str(error), 0.0, "", "")
    try:
        module.write_text(mutated)
        _drop_bytecode(module)
        result, failure, seconds, _ = run_tests(tree, tests or COVERING_TESTS[mutant.package], timeout, python)
    finally:
        module.write_text(source)
        _drop_bytecode(module)
    status = {"passed": "survived", "failed": "killed", "timeout": "timeout"}[result]
    return Outcome(mutant.ident, mutant.package, status, failure, round(seconds, 1), original, new_text)


# ---------------------------------------------------------------- reporting


def kill_rate(outcomes: Sequence[Outcome]) -> dict:
    """Killed (timeouts included) over valid mutants, with the 95% Clopper-Pearson interval."""
    from scipy.stats import binomtest

    valid = [o for o in outcomes if o.status != "invalid"]
    killed = sum(o.status in ("killed", "timeout") for o in valid)
    row = {"mutants": len(valid), "killed": killed, "timeouts": sum(o.status == "timeout" for o in valid),
           "survived": len(valid) - killed, "rate": None, "ci95": None}
    if valid:
        interval = binomtest(killed, len(valid)).proportion_ci(confidence_level=0.95, method="exact")
        row.update(rate=killed / len(valid), ci95=[interval.low, interval.high])
    return row


def markdown_table(summary: dict[str, dict], enumerated: dict[str, int]) -> str:
    """Kill rates per package as a markdown table."""
    lines = ["| package | mutants enumerated | sampled | killed (timeouts) | survived | kill rate | 95% CI |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for package, row in summary.items():
        rate = "-" if row["rate"] is None else f"{row['rate']:.0%}"
        ci = "-" if row["ci95"] is None else f"{row['ci95'][0]:.0%}-{row['ci95'][1]:.0%}"
        lines.append(f"| {package} | {enumerated.get(package, '-')} | {row['mutants']} | {row['killed']} "
                     f"({row['timeouts']}) | {row['survived']} | {rate} | {ci} |")
    survivors = [o for rows in summary.values() for o in rows.get("survivors", [])]
    if survivors:
        lines += ["", "Survivors:", ""] + [f"- `{s}`" for s in survivors]
    return "\n".join(lines) + "\n"


def summarize(outcomes: Sequence[Outcome]) -> dict[str, dict]:
    """Per-package kill rates and survivor idents."""
    summary: dict[str, dict] = {}
    for package in PACKAGES:
        mine = [o for o in outcomes if o.package == package]
        if mine:
            summary[package] = kill_rate(mine) | {"survivors": [o.ident for o in mine if o.status == "survived"]}
    return summary


# ---------------------------------------------------------------- command line


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", type=Path, action="append", dest="trees",
                        help="clone to mutate (repeat for one mutant at a time per clone)")
    parser.add_argument("--package", action="append", choices=PACKAGES, help="packages (default: all four)")
    parser.add_argument("--sample", type=int, default=25, help="mutants per package (default 25)")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    parser.add_argument("--only", action="append", default=[], metavar="FILE:LINE:OP",
                        help="run this mutant (repeatable; no sampling)")
    parser.add_argument("--tests", nargs="+", metavar="FILE",
                        help="run these test files instead of the package's covering tests (a survivor's check)")
    parser.add_argument("--list", action="store_true", help="print the mutants (sampled or --only) and stop")
    parser.add_argument("--timeout-factor", type=float, default=3.0,
                        help="timeout = factor x the baseline's seconds + 60 (default 3)")
    parser.add_argument("--skip-baseline", action="store_true", help="trust that the covering tests pass")
    parser.add_argument("--json", type=Path, default=Path("mutation.json"))
    parser.add_argument("--markdown", type=Path, default=Path("mutation.md"))
    parser.add_argument("--python", default=sys.executable)
    args = parser.parse_args(argv)
    args.trees = args.trees or [Path(__file__).resolve().parents[1]]
    args.package = args.package or list(PACKAGES)
    return args


def select_mutants(root: Path, args: argparse.Namespace) -> tuple[list[Mutant], dict[str, int]]:
    """The mutants to run (the named ones, or a sample per package) and how many each package has."""
    every = {package: enumerate_mutants(root, package) for package in args.package}
    counts = {package: len(mutants) for package, mutants in every.items()}
    if args.only:
        by_ident = {m.ident: m for mutants in every.values() for m in mutants}
        missing = [name for name in args.only if name not in by_ident]
        if missing:
            raise SystemExit(f"unknown mutants: {missing}")
        return [by_ident[name] for name in args.only], counts
    return [m for package in args.package
            for m in sample_mutants(every[package], args.sample, args.seed, package)], counts


def baseline(trees: Sequence[Path], packages: Sequence[str], python: str,
             tests: Sequence[str] | None = None) -> dict[str, float]:
    """Runs each package's covering tests (or `tests`, once) unmutated, one package per tree at a time.

    Exits when any fails: the kill rates would mean nothing. Returns seconds per package.
    """
    def one(tree: Path, package: str) -> float:
        result, failure, took, tail = run_tests(tree, tests or COVERING_TESTS[package], 3600, python)
        print(f"baseline {package}: {result} in {took:.0f} s", flush=True)
        if result != "passed":
            raise SystemExit(f"baseline of {package} fails ({failure}); the numbers would mean nothing\n{tail}")
        return took

    if tests:  # the same tests for every package: run them once
        seconds = one(trees[0], packages[0])
        return {package: seconds for package in packages}
    return dict(zip(packages, _on_trees(trees, packages, one)))


def _on_trees(trees: Sequence[Path], items: Sequence, work) -> list:
    """``work(tree, item)`` for each item, one item at a time per tree, results in item order."""
    free = list(trees)
    lock = threading.Lock()

    def job(item):
        with lock:
            tree = free.pop()
        try:
            return work(tree, item)
        finally:
            with lock:
                free.append(tree)

    with ThreadPoolExecutor(max_workers=len(trees)) as pool:
        return list(pool.map(job, items))


def run_all(mutants: Sequence[Mutant], trees: Sequence[Path], timeouts: dict[str, float], python: str,
            report: Callable[[list[Outcome]], None], tests: Sequence[str] | None = None) -> list[Outcome]:
    """Runs the mutants, one at a time per tree; prints each outcome and `report`s all so far."""
    done: list[Outcome] = []
    lock = threading.Lock()

    def work(tree: Path, mutant: Mutant) -> Outcome:
        outcome = run_mutant(tree, mutant, timeouts[mutant.package], python, tests)
        print(f"{outcome.status:8} {outcome.seconds:6.0f} s  {mutant.ident}  "
              f"[{outcome.original[:60]!r} -> {outcome.mutated[:60]!r}]  {outcome.killed_by or ''}", flush=True)
        with lock:
            done.append(outcome)
            report(done)
        return outcome

    return _on_trees(trees, mutants, work)


def interleave(mutants: Sequence[Mutant]) -> list[Mutant]:
    """The mutants taken round-robin across packages, so that a run cut short has each package alike."""
    queues = [[m for m in mutants if m.package == p] for p in PACKAGES]
    return [q[i] for i in range(max(map(len, queues), default=0)) for q in queues if i < len(q)]


def write_reports(args: argparse.Namespace, meta: dict, counts: dict[str, int], outcomes: Sequence[Outcome]) -> str:
    """Writes the JSON and the markdown table of `outcomes`; returns the table."""
    summary = summarize(outcomes)
    table = markdown_table(summary, counts)
    args.json.write_text(json.dumps(meta | {
        "written": _now(), "enumerated": counts, "summary": summary,
        "mutants": [dataclasses.asdict(o) for o in outcomes],
    }, indent=1))
    args.markdown.write_text(table)
    return table


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    for tree in args.trees:
        check_tree(tree, args.python)
    mutants, counts = select_mutants(args.trees[0], args)
    if args.list:
        for mutant in mutants:
            print(mutant.ident)
        return 0
    packages = sorted({m.package for m in mutants}, key=PACKAGES.index)
    meta = {"started": _now(), "seed": args.seed, "sample": args.sample, "only": args.only,
            "trees": [str(t) for t in args.trees], "tests": args.tests,
            "covering_tests": {p: COVERING_TESTS[p] for p in packages}}
    if args.skip_baseline:
        base = {p: 600.0 for p in packages}
    else:
        base = baseline(args.trees, packages, args.python, args.tests)
    meta |= {"baseline_seconds": base, "timeouts": {p: args.timeout_factor * s + 60 for p, s in base.items()}}
    outcomes = run_all(interleave(mutants), args.trees, meta["timeouts"], args.python,
                       lambda done: write_reports(args, meta, counts, done), args.tests)
    print(write_reports(args, meta | {"finished": _now()}, counts, outcomes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
