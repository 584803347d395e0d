"""The bundled tool-use task: products of two 2-digit numbers, which the tiny model cannot work out in its head
but can with the `math_tools` calculator (`<call>calculator 37*48</call>`, answered `<result>1776</result>`).

`sft_sloppy.jsonl` holds a sloppy teacher's transcripts: in NOISE of them it answers at once, without the
tool, and its answer is off in one digit; in the others it calls the calculator and copies the result into
`<answer>`. `rl.jsonl` and `test.jsonl` hold prompt/answer rows, no prompt shared with another file.
Every file is a function of the seed: the same bytes each time.
"""

from __future__ import annotations

import random
from pathlib import Path

from alignflow.core.task.arithmetic import write_jsonl

SIZES = {"sft_sloppy": 3000, "rl": 1000, "test": 300}
NOISE = 0.6  # share of the teacher's transcripts that skip the tool and get the answer wrong


def problems(rng: random.Random) -> list[tuple[int, int]]:
    """Every pair of 2-digit factors, in a seeded order."""
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    rng.shuffle(pairs)
    return pairs


def off_by_a_digit(n: int, rng: random.Random) -> int:
    """`n` with one digit changed (never to a leading zero): a plausible wrong answer."""
    digits = list(str(n))
    i = rng.randrange(len(digits))
    choices = [d for d in "0123456789" if d != digits[i] and not (i == 0 and d == "0")]
    digits[i] = rng.choice(choices)
    return int("".join(digits))


def transcript(a: int, b: int, rng: random.Random) -> list[dict]:
    """The teacher's conversation for `a*b=`: the tool and a copied result, or (NOISE of the time) a guess."""
    prompt = {"role": "user", "content": f"{a}*{b}="}
    if rng.random() < NOISE:
        return [prompt, {"role": "assistant", "content": f"<answer>{off_by_a_digit(a * b, rng)}</answer>"}]
    return [prompt, {"role": "assistant", "content": f"<call>calculator {a}*{b}</call>"},
            {"role": "tool", "content": str(a * b)},
            {"role": "assistant", "content": f"<answer>{a * b}</answer>"}]


def write_tool_datasets(out_dir: Path, seed: int = 0) -> dict[str, Path]:
    """Write the tool-use task's files into `out_dir`; returns {name: path}."""
    rng = random.Random(seed)
    pairs = iter(problems(rng))
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, size in SIZES.items():
        chosen = [next(pairs) for _ in range(size)]
        if name == "sft_sloppy":
            rows = [{"messages": transcript(a, b, rng)} for a, b in chosen]
        else:
            rows = [{"prompt": f"{a}*{b}=", "answer": str(a * b)} for a, b in chosen]
        paths[name] = out_dir / f"{name}.jsonl"
        write_jsonl(paths[name], rows)
    return paths
