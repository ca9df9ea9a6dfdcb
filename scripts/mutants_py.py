#!/usr/bin/env python3
"""Mutation testing of one Python source file of the package, as cargo-mutants does for Rust.

    scripts/mutants_py.py FILE [--tests PYTEST-ARGS] [--python PY] [--re REGEX] [--list]

Run through scripts/mutants.sh (which gives the run a /dev/shm of its own), e.g.
    scripts/mutants.sh python/shmstore/vllm/item_format.py 1 --tests "python/tests_vllm/test_vllm_items.py"

Why not mutmut: mutmut 3 runs the mutated code only in the pytest process (trampolines in a
copied tree, chosen by which tests call which function), and the package's tests do most of
their work in other processes (vLLM's workers, front-ends started with `python -c`). Here
each mutant is a whole copy of the package on PYTHONPATH, which every process a test starts
inherits, so a mutant is seen wherever the code runs.

How it runs:
- The package (python/shmstore, with the built `_native` module and the `shmstore` tool
  beside it) is copied to a scratch directory that goes first on PYTHONPATH. Before any
  mutant, the tests must pass on the unchanged copy, and must fail on a copy whose FILE
  raises on import (so they do import the copy, not the editable install).
- Each mutant changes FILE's copy in one place: a comparison (`==`/`!=`, `is`/`is not`,
  `in`/`not in`, `<` to `<=` and back), `and`/`or`, a dropped `not`, an arithmetic or bit
  operator (also in `+=`), `True`/`False`, an integer plus one, a `return X` made
  `return None`, a call made a bare statement deleted (`pass`), an `if`/`while` condition
  that is a plain name or call negated. A line with `# mutants: skip` is left alone.
- The tests run once per mutant (`pytest -x`, a timeout of 3x the unchanged run, at least
  60 s). A mutant is CAUGHT when they fail, MISSED when they pass, TIMEOUT when they hang
  (counted as caught, as cargo-mutants does), UNVIABLE when the copy does not compile.
- Results go to target/mutants-py/<FILE with / as _>/: outcomes.txt (one line per mutant)
  and missed.txt (the missed ones, with the changed line before and after).
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "python" / "shmstore"


@dataclass
class Mutant:
    start: int  # byte offsets into the file
    end: int
    replacement: bytes
    line: int
    col: int
    what: str
    function: str

    def name(self, rel: str) -> str:
        return f"{rel}:{self.line}:{self.col + 1}: {self.what} in {self.function}"


COMPARE_SWAPS = {
    ast.Eq: ("==", "!="),
    ast.NotEq: ("!=", "=="),
    ast.Lt: ("<", "<="),
    ast.LtE: ("<=", "<"),
    ast.Gt: (">", ">="),
    ast.GtE: (">=", ">"),
    ast.Is: ("is", "is not"),
    ast.IsNot: ("is not", "is"),
    ast.In: ("in", "not in"),
    ast.NotIn: ("not in", "in"),
}
BIN_SWAPS = {
    ast.Add: ("+", "-"),
    ast.Sub: ("-", "+"),
    ast.Mult: ("*", "+"),
    ast.FloorDiv: ("//", "*"),
    ast.Div: ("/", "*"),
    ast.Mod: ("%", "//"),
    ast.BitAnd: ("&", "|"),
    ast.BitOr: ("|", "&"),
    ast.BitXor: ("^", "|"),
    ast.LShift: ("<<", ">>"),
    ast.RShift: (">>", "<<"),
}


def _op_pattern(op: str) -> re.Pattern[bytes]:
    words = op.split()
    if words[0].isalpha():
        return re.compile(rb"\b" + rb"\s+".join(w.encode() for w in words) + rb"\b")
    # An operator of symbols, not part of a longer one (`<` is not the start of `<=`/`<<`).
    sym = re.escape(op.encode())
    return re.compile(rb"(?<![<>=!*/&|^%+-])" + sym + rb"(?![<>=*/])")


class Finder(ast.NodeVisitor):
    """Collects the mutants of a module, with byte offsets into its source."""

    def __init__(self, source: bytes) -> None:
        self.source = source
        self.line_starts = [0]
        for i, b in enumerate(source):
            if b == 0x0A:
                self.line_starts.append(i + 1)
        self.lines = source.split(b"\n")
        self.functions: list[str] = []
        self.mutants: list[Mutant] = []

    def off(self, line: int, col: int) -> int:
        return self.line_starts[line - 1] + col

    def start(self, node: ast.AST) -> int:
        return self.off(node.lineno, node.col_offset)  # type: ignore[attr-defined]

    def end(self, node: ast.AST) -> int:
        return self.off(node.end_lineno, node.end_col_offset)  # type: ignore[attr-defined]

    def add(self, start: int, end: int, replacement: bytes, what: str) -> None:
        line = next(i for i in range(len(self.line_starts), 0, -1)
                    if self.line_starts[i - 1] <= start)
        if b"# mutants: skip" in self.lines[line - 1]:
            return
        fn = ".".join(self.functions) or "<module>"
        self.mutants.append(Mutant(start, end, replacement, line,
                                   start - self.line_starts[line - 1], what, fn))

    def op_between(self, left: ast.AST, right: ast.AST, op: str, new: str) -> None:
        a, b = self.end(left), self.start(right)
        m = _op_pattern(op).search(self.source, a, b)
        if m:
            self.add(m.start(), m.end(), new.encode(), f"replace {op} with {new}")

    # Scopes, for the names in the report.
    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        # Annotations are not run (the package has `from __future__ import annotations`).
        for d in node.decorator_list:
            self.visit(d)
        for default in [*node.args.defaults, *node.args.kw_defaults]:
            if default is not None:
                self.visit(default)
        self.functions.append(node.name)
        for stmt in node.body:
            self.visit(stmt)
        self.functions.pop()

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        if node.value is not None:
            self.visit(node.value)

    visit_AsyncFunctionDef = visit_FunctionDef  # type: ignore[assignment]

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.functions.append(node.name)
        self.generic_visit(node)
        self.functions.pop()

    def visit_If(self, node: ast.If) -> None:
        # `if TYPE_CHECKING:` blocks never run.
        if isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            return
        self.negate_plain_condition(node.test)
        self.generic_visit(node)

    def visit_While(self, node: ast.While) -> None:
        self.negate_plain_condition(node.test)
        self.generic_visit(node)

    def negate_plain_condition(self, test: ast.expr) -> None:
        # Comparisons, `and`/`or` and `not` have mutants of their own.
        if isinstance(test, (ast.Name, ast.Attribute, ast.Call)):
            text = self.source[self.start(test):self.end(test)]
            self.add(self.start(test), self.end(test), b"not (" + text + b")",
                     "negate the condition")

    def visit_Compare(self, node: ast.Compare) -> None:
        left: ast.AST = node.left
        for op, right in zip(node.ops, node.comparators):
            old, new = COMPARE_SWAPS[type(op)]
            self.op_between(left, right, old, new)
            left = right
        self.generic_visit(node)

    def visit_BoolOp(self, node: ast.BoolOp) -> None:
        old, new = ("and", "or") if isinstance(node.op, ast.And) else ("or", "and")
        for left, right in zip(node.values, node.values[1:]):
            self.op_between(left, right, old, new)
        self.generic_visit(node)

    def visit_UnaryOp(self, node: ast.UnaryOp) -> None:
        if isinstance(node.op, ast.Not):
            text = self.source[self.start(node.operand):self.end(node.operand)]
            self.add(self.start(node), self.end(node), b"(" + text + b")", "delete not")
        self.generic_visit(node)

    def visit_BinOp(self, node: ast.BinOp) -> None:
        swap = BIN_SWAPS.get(type(node.op))
        # `%` between a string and its arguments is formatting, not arithmetic.
        is_format = isinstance(node.op, ast.Mod) and isinstance(node.left, (ast.Constant, ast.JoinedStr)) \
            and isinstance(getattr(node.left, "value", None), (str, type(None)))
        if swap and not is_format:
            self.op_between(node.left, node.right, *swap)
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        swap = BIN_SWAPS.get(type(node.op))
        if swap:
            self.op_between(node.target, node.value, swap[0] + "=", swap[1] + "=")
        self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant) -> None:
        v = node.value
        if v is True or v is False:
            self.add(self.start(node), self.end(node), str(not v).encode(),
                     f"replace {v} with {not v}")
        elif isinstance(v, int):
            self.add(self.start(node), self.end(node), str(v + 1).encode(),
                     f"replace {v} with {v + 1}")

    def visit_Return(self, node: ast.Return) -> None:
        if node.value is not None and not (isinstance(node.value, ast.Constant)
                                           and node.value.value is None):
            self.add(self.start(node), self.end(node), b"return None",
                     "replace the return value with None")
        self.generic_visit(node)

    def visit_Expr(self, node: ast.Expr) -> None:
        if isinstance(node.value, (ast.Call, ast.Await)):
            self.add(self.start(node), self.end(node), b"pass", "delete the call")
        self.generic_visit(node)

    def visit_JoinedStr(self, node: ast.JoinedStr) -> None:
        # Messages: their wording is checked where it matters, not operator by operator.
        return


def find_mutants(path: Path) -> list[Mutant]:
    source = path.read_bytes()
    finder = Finder(source)
    finder.visit(ast.parse(source, filename=str(path)))
    # One mutant per place and change (a comparison inside `not` is two mutants, not more).
    seen: set[tuple[int, int, bytes]] = set()
    out = []
    for m in sorted(finder.mutants, key=lambda m: (m.start, m.end)):
        key = (m.start, m.end, m.replacement)
        if key not in seen:
            seen.add(key)
            out.append(m)
    return out


def run_tests(python: str, tests: list[str], pythonpath: Path, timeout: float) -> tuple[str, float]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(pythonpath), *filter(None, [env.get("PYTHONPATH")])])
    cmd = [python, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
    t = time.monotonic()
    try:
        # A group of its own, so a timeout kills the workers a test started too.
        p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
        rc = p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, 9)
        p.wait()
        return "TIMEOUT", time.monotonic() - t
    return ("MISSED" if rc == 0 else "CAUGHT"), time.monotonic() - t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("file", help="a file under python/shmstore, e.g. python/shmstore/vllm/gate.py")
    ap.add_argument("--tests", default="python/tests python/tests_vllm",
                    help="pytest arguments (one string), default both suites")
    venv = ROOT / "python" / ".venv-vllm" / "bin" / "python"
    ap.add_argument("--python", default=str(venv if venv.exists() else sys.executable))
    ap.add_argument("--re", dest="regex", help="only the mutants whose name matches")
    ap.add_argument("--list", action="store_true", help="list the mutants and stop")
    ap.add_argument("-o", "--output", help="output directory (default target/mutants-py/<FILE>)")
    args = ap.parse_args()

    target = (ROOT / args.file).resolve()
    rel_to_package = target.relative_to(PACKAGE)  # raises if FILE is not in the package
    rel = str(target.relative_to(ROOT))
    mutants = find_mutants(target)
    if args.regex:
        mutants = [m for m in mutants if re.search(args.regex, m.name(rel))]
    if args.list:
        for m in mutants:
            print(m.name(rel))
        return 0

    out = Path(args.output) if args.output else ROOT / "target" / "mutants-py" / rel.replace("/", "_")
    out.mkdir(parents=True, exist_ok=True)
    tests = shlex.split(args.tests)
    scratch = Path(tempfile.mkdtemp(prefix="shmstore-mutants-py-"))
    try:
        copy = scratch / "shmstore"
        shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
        copied = copy / rel_to_package
        original = target.read_bytes()

        outcome, secs = run_tests(args.python, tests, scratch, timeout=3600)
        print(f"unchanged copy: tests {'pass' if outcome == 'MISSED' else 'FAIL'} in {secs:.0f} s",
              flush=True)
        if outcome != "MISSED":
            print("the tests must pass on the unchanged code first", file=sys.stderr)
            return 2
        timeout = max(60.0, 3 * secs)
        copied.write_bytes(b"raise ImportError('mutants_py canary')\n" + original)
        canary, _ = run_tests(args.python, tests, scratch, timeout=timeout)
        if canary != "CAUGHT":
            print("the tests pass when the copy cannot be imported: they do not use it "
                  "(is the package installed other than editable, or PYTHONPATH overridden?)",
                  file=sys.stderr)
            return 2
        print(f"canary caught: the tests import the copy. {len(mutants)} mutants, "
              f"timeout {timeout:.0f} s each", flush=True)

        counts: dict[str, int] = {}
        with open(out / "outcomes.txt", "w") as log, open(out / "missed.txt", "w") as missed:
            for m in mutants:
                changed = original[:m.start] + m.replacement + original[m.end:]
                try:
                    compile(changed, str(copied), "exec")
                except SyntaxError:
                    result, secs = "UNVIABLE", 0.0
                else:
                    copied.write_bytes(changed)
                    shutil.rmtree(copied.parent / "__pycache__", ignore_errors=True)
                    result, secs = run_tests(args.python, tests, scratch, timeout)
                counts[result] = counts.get(result, 0) + 1
                line = f"{result:8} {m.name(rel)} in {secs:.0f}s"
                print(line, flush=True)
                log.write(line + "\n")
                log.flush()
                if result == "MISSED":
                    before = original.split(b"\n")[m.line - 1].decode()
                    after = changed.split(b"\n")[m.line - 1].decode()
                    missed.write(f"{m.name(rel)}\n  - {before.strip()}\n  + {after.strip()}\n")
                    missed.flush()
        copied.write_bytes(original)
        print(", ".join(f"{n} {k.lower()}" for k, n in sorted(counts.items())),
              f"of {len(mutants)}; results in {out}")
        return 0
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
