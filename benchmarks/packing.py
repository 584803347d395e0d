"""Trainer forward+backward of one micro-batch of GRPO groups: padded, packed, packed with shared prompts.

    python benchmarks/packing.py --model PATH [--groups 4] [--group-size 8] [--prompt-repeat 1] [--reps 10]

Each group is one arithmetic prompt (repeated `--prompt-repeat` times, to model long prompts) with
`--group-size` random completions of 18-32 tokens. The three ways alternate within each repetition (after
3 warm-up rounds); medians in ms and ratios to padded, as JSON. One torch thread.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from alignflow.core.train import packing
from alignflow.core.train.models import load_model, load_tokenizer, token_logprobs


def batch(tok, groups: int, size: int, repeat: int, seed: int = 0):
    rng = random.Random(seed)
    rows, prompts = [], []
    for _ in range(groups):
        p = tok(f"{rng.randint(100, 999)}*{rng.randint(2, 9)}=").input_ids * repeat
        for _ in range(size):
            rows.append(p + [rng.randint(3, 200) for _ in range(rng.randint(18, 32))] + [tok.eos_token_id])
            prompts.append(len(p))
    T = max(map(len, rows))
    ids = torch.tensor([r + [tok.pad_token_id] * (T - len(r)) for r in rows])
    attn = (torch.arange(T)[None] < torch.tensor([len(r) for r in rows])[:, None]).long()
    labels = attn.clone()
    for i, p in enumerate(prompts):
        labels[i, :p] = 0
    return ids, attn, labels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompt-repeat", type=int, default=1)
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tok = load_model(args.model), load_tokenizer(args.model)
    ids, attn, labels = batch(tok, args.groups, args.group_size, args.prompt_repeat)
    mask = labels.bool()

    def run(way: str) -> float:
        start = time.perf_counter()
        model.zero_grad()
        if way == "padded":
            lp = token_logprobs(model, ids, attn, labels, packed=False)
        else:
            lp = packing.packed_token_logprobs(model, ids, attn, mask, 1.0, False, share_prompts=way == "shared")
        lp.sum().backward()
        return time.perf_counter() - start

    ways = ("padded", "packed", "shared")
    times: dict[str, list[float]] = {w: [] for w in ways}
    for rep in range(3 + args.reps):
        for w in ways:
            t = run(w)
            if rep >= 3:
                times[w].append(t)
    ms = {w: 1000 * statistics.median(v) for w, v in times.items()}
    print(json.dumps({"config": {**vars(args), "rows": len(ids), "real_tokens": int(attn.sum()),
                                 "padded_tokens": int(attn.numel())},
                      "median_ms": ms, "ratio_to_padded": {w: ms[w] / ms["padded"] for w in ways}}, indent=2))


if __name__ == "__main__":
    main()
