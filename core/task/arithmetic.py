"""The bundled arithmetic-reasoning task: problems, worked R1-format solutions and datasets.

A solution works column by column from the right, one space-separated step per column:
``37+48=`` -> ``<think>7+8=15 3+4+1=8</think><answer>85</answer>``. A carry shows as ``+c`` in
the next column; a borrow as a ``1`` before the top digit and ``-1`` in the next column
(``52-17=`` -> ``12-7=5 5-1-1=3``); ``47*6=`` -> ``7*6=42 4*6+4=28``. The answer is the last
column's value followed by the other columns' last digits, so every step is local and short.

`sft_noisy.jsonl` holds the same kind of worked solutions from a sloppy teacher: in NOISE of the
solutions that take a carry or borrow, the teacher forgets the first one (and follows through
consistently). A model trained on it inherits the habit, so its greedy answers are wrong on most
such problems while correct solutions stay within its sampling reach: the cold start the RL stages
of `pipelines/r1-tiny.yaml` improve on with the verifier reward alone.

`safe_sft.jsonl`, `safe_rl.jsonl` and `safe_test.jsonl` are the sloppy teacher's, rl's and test's
problems with a per-prompt constraint for constrained RL (`pipelines/safe-tiny.yaml`): SAFE_SHARE of
the prompts start with ``!`` and have ``"restricted": true``, asking for the answer alone, with no
worked steps shown (``!37+48=`` -> ``<think></think><answer>85</answer>``). Every right answer can
comply; the teacher shows its steps anyway on SAFE_LEAK of the restricted demonstrations, so the
policy trained on them sometimes does, and showing steps makes a right answer likelier: the verifier
reward alone teaches the policy to break the constraint.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from pathlib import Path

LEVELS = {
    1: "add/sub, 1-2 digit operands",
    2: "add/sub, 2-3 digit operands, at least one carry or borrow",
    3: "2-digit x 1-digit multiplication",
    4: "3-digit x 1-digit multiplication",
}
# Share of each level in every dataset; level 3 has only 720 distinct problems, which bounds it.
LEVEL_WEIGHTS = {1: 6, 2: 6, 3: 3, 4: 5}
SIZES = {"sft": 4000, "sft_noisy": 4000, "rl": 1500, "test": 500, "pairs": 1500, "unpaired": 1500,
         "steps": 1500}
NOISE = 0.6  # share of sft_noisy solutions with a carry or borrow in which the first one is dropped
SAFE = {"safe_sft": "sft_noisy", "safe_rl": "rl", "safe_test": "test"}  # constrained copies of these files
SAFE_SHARE = 0.25  # share of the safe_* prompts that are restricted ("!": the answer alone, no steps shown)
SAFE_LEAK = 0.2  # share of the restricted safe_sft demonstrations that show their steps anyway
RESTRICTED = "!"

_PROMPT = re.compile(r"^!?(\d+)([+\-*])(\d+)=$")  # "!": restricted (safe_*)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)


@dataclass(frozen=True)
class Problem:
    """One problem: ``a op b``, with the difficulty level it was drawn at."""

    a: int
    op: str
    b: int
    level: int = 0

    @property
    def prompt(self) -> str:
        return f"{self.a}{self.op}{self.b}="

    @property
    def answer(self) -> str:
        return str(evaluate(self.a, self.op, self.b))

    def steps(self) -> list[str]:
        """The worked column steps of the correct solution."""
        return work(self.a, self.op, self.b)[0]

    def completion(self) -> str:
        return render(self.steps(), self.answer)

    def carry_columns(self) -> list[int]:
        """Columns (0 = rightmost) that take an incoming carry or borrow: a third term on the left."""
        return [i for i, step in enumerate(self.steps()) if len(re.findall(r"[+\-*]", step.split("=")[0])) >= 2]


def evaluate(a: int, op: str, b: int) -> int:
    return {"+": a + b, "-": a - b, "*": a * b}[op]


def render(steps: list[str], answer: str) -> str:
    """An R1-format completion from worked steps and a final answer."""
    return f"<think>{' '.join(steps)}</think><answer>{answer}</answer>"


def _digits(n: int) -> list[int]:
    return [int(d) for d in reversed(str(n))]


def _column(op: str, x: int, y: int, c: int, slip: int, last: bool) -> tuple[str, int, int] | None:
    """One column: (step text, value written, carry out); None if the column is impossible."""
    lhs = f"{x}{op}{y}" + (f"{'-' if op == '-' else '+'}{c}" if c else "")
    if op == "-":
        v = x - y - c + slip
        if v >= 0:
            return f"{lhs}={v}", v, 0
        # Borrow: the top digit is read as 1x, and the next column pays the 1 back.
        return None if last else (f"1{lhs}={v + 10}", v + 10, 1)
    v = (x * y if op == "*" else x + y) + c + slip
    return (f"{lhs}={v}", v, v // 10) if v >= 0 else None


def work(a: int, op: str, b: int, fault: tuple[int, str] | None = None) -> tuple[list[str], str] | None:
    """Worked steps and the answer they lead to; `fault=(column, kind)` injects one mistake.

    Fault kinds: "up"/"down" slip the column's result by one, "carry" drops the incoming carry
    or borrow (or invents one when there is none). Later columns follow the faulty result
    consistently, as a student would. Returns None when the fault makes an impossible step.
    """
    xs = _digits(a)
    ys = [b] * len(xs) if op == "*" else _digits(b)
    n = max(len(xs), len(ys))
    xs, ys = xs + [0] * (n - len(xs)), ys + [0] * (n - len(ys))
    steps, written, c = [], [], 0
    for i in range(n):
        kind = fault[1] if fault and fault[0] == i else None
        if kind == "carry":
            c = 0 if c else 1
        slip = {"up": 1, "down": -1}.get(kind, 0)
        col = _column(op, xs[i], ys[i], c, slip, last=i == n - 1)
        if col is None:
            return None
        text, v, c = col
        steps.append(text)
        written.append(str(v) if i == n - 1 else str(v % 10))
    return steps, str(int("".join(reversed(written))))


def generate(level: int, rng: random.Random) -> Problem:
    """A random problem of the given difficulty level (see LEVELS)."""
    if level in (3, 4):
        lo = 10 if level == 3 else 100
        return Problem(rng.randrange(lo, lo * 10), "*", rng.randrange(2, 10), level)
    if level not in (1, 2):
        raise ValueError(f"unknown level {level!r}: expected one of {sorted(LEVELS)}")
    while True:
        lo, hi = (0, 100) if level == 1 else (10, 1000)
        a, b, op = rng.randrange(lo, hi), rng.randrange(lo, hi), rng.choice("+-")
        if op == "-" and a < b:
            a, b = b, a
        if level == 1 or Problem(a, op, b).carry_columns():
            return Problem(a, op, b, level)


def corrupt(problem: Problem, rng: random.Random) -> tuple[list[str], str, int]:
    """A plausible wrong solution: (steps, wrong answer, index of the first wrong step)."""
    n = len(problem.steps())
    faults = [(i, k) for i in range(n) for k in ("up", "down", "carry") if k != "carry" or i > 0]
    rng.shuffle(faults)
    for fault in faults:
        out = work(problem.a, problem.op, problem.b, fault)
        if out is not None and out[1] != problem.answer:
            return out[0], out[1], fault[0]
    raise AssertionError(f"no valid fault for {problem.prompt}")  # unreachable: "up" always works


def sloppy(problem: Problem, rng: random.Random) -> tuple[list[str], str]:
    """The sloppy teacher's solution: with probability NOISE, the first carry or borrow is dropped."""
    columns = problem.carry_columns()
    if columns and rng.random() < NOISE:
        dropped = work(problem.a, problem.op, problem.b, (columns[0], "carry"))
        if dropped is not None:  # always, in fact: a dropped carry never makes a negative column
            return dropped
    return problem.steps(), problem.answer


def parse(prompt: str) -> tuple[int, str, int] | None:
    m = _PROMPT.match(prompt.strip())
    return (int(m[1]), m[2], int(m[3])) if m else None


def extract_answer(completion: str) -> str | None:
    """The text inside the last ``<answer>...</answer>``, or None."""
    found = _ANSWER.findall(completion)
    return found[-1].strip() if found else None


def verify(prompt: str, answer: str | None) -> bool:
    """Whether `answer` (a bare number) is the true result of the problem in `prompt`."""
    parsed = parse(prompt)
    if parsed is None or answer is None or not re.fullmatch(r"-?\d+", answer.strip()):
        return False
    return int(answer.strip()) == evaluate(*parsed)


def _level_counts(n: int) -> dict[int, int]:
    total = sum(LEVEL_WEIGHTS.values())
    counts = {lv: n * w // total for lv, w in LEVEL_WEIGHTS.items()}
    counts[1] += n - sum(counts.values())
    return counts


def draw(n: int, rng: random.Random, exclude: frozenset[str] = frozenset()) -> list[Problem]:
    """`n` problems with distinct prompts, none in `exclude`, mixed by LEVEL_WEIGHTS, shuffled."""
    seen, out = set(exclude), []
    for level, k in _level_counts(n).items():
        misses = 0
        while k:
            p = generate(level, rng)
            if p.prompt not in seen:
                seen.add(p.prompt)
                out.append(p)
                k, misses = k - 1, 0
            elif (misses := misses + 1) > 100_000:
                raise ValueError(f"level {level}: cannot draw {k} more distinct problems ({len(out)} drawn "
                                 "so far, none new in 100000 tries): ask for fewer")
    rng.shuffle(out)
    return out


def _rows(name: str, problems: list[Problem], rng: random.Random) -> list[dict]:
    rows = []
    for i, p in enumerate(problems):
        if name == "sft":
            rows.append({"prompt": p.prompt, "completion": p.completion()})
        elif name == "sft_noisy":
            rows.append({"prompt": p.prompt, "completion": render(*sloppy(p, rng))})
        elif name in ("rl", "test"):
            rows.append({"prompt": p.prompt, "answer": p.answer, "level": p.level})
        elif name == "pairs":
            steps, wrong, _ = corrupt(p, rng)
            rows.append({"prompt": p.prompt, "chosen": p.completion(), "rejected": render(steps, wrong)})
        else:  # unpaired and steps: alternate correct and faulty solutions
            good = i % 2 == 0
            steps, ans, first_bad = (p.steps(), p.answer, len(p.steps())) if good else corrupt(p, rng)
            if name == "unpaired":
                rows.append({"prompt": p.prompt, "completion": render(steps, ans), "label": good})
            else:
                labels = [j < first_bad for j in range(len(steps))]
                rows.append({"prompt": p.prompt, "steps": steps, "step_labels": labels})
    return rows


def _safe_rows(name: str, problems: list[Problem], rng: random.Random) -> list[dict]:
    """The rows of a safe_* file: SAFE_SHARE of the prompts restricted (see the module docstring)."""
    rows = []
    for p in problems:
        restricted = rng.random() < SAFE_SHARE
        prompt = RESTRICTED + p.prompt if restricted else p.prompt
        if name != "safe_sft":
            rows.append({"prompt": prompt, "answer": p.answer, "level": p.level, "restricted": restricted})
        elif restricted and rng.random() >= SAFE_LEAK:
            rows.append({"prompt": prompt, "completion": render([], p.answer), "restricted": True})
        else:
            rows.append({"prompt": prompt, "completion": render(*sloppy(p, rng)), "restricted": restricted})
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> None:
    """Rows as JSONL with sorted keys and '\\n' line ends, so equal rows give equal bytes."""
    text = "".join(json.dumps(r, sort_keys=True, ensure_ascii=True) + "\n" for r in rows)
    path.write_bytes(text.encode("ascii"))


def write_datasets(out_dir: Path, seed: int = 0) -> dict[str, Path]:
    """Write every dataset the tiny pipelines use; byte-identical for a given seed.

    test.jsonl shares no prompt with any other file. Returns {name: path}.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # str seeds are hashed with SHA-512 by `random`, so they are stable across runs and machines.
    test = draw(SIZES["test"], random.Random(f"{seed}/test"))
    held_out = frozenset(p.prompt for p in test)
    paths, drawn = {}, {}
    for name in SIZES:
        rng = random.Random(f"{seed}/{name}/rows")
        drawn[name] = problems = test if name == "test" else draw(SIZES[name], rng, held_out)
        paths[name] = out_dir / f"{name}.jsonl"
        write_jsonl(paths[name], _rows(name, problems, rng))
    for name, base in SAFE.items():
        paths[name] = out_dir / f"{name}.jsonl"
        write_jsonl(paths[name], _safe_rows(name, drawn[base], random.Random(f"{seed}/{name}/rows")))
    return paths
