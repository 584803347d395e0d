"""A tiny training run through `Engine`, run as a script by the multi-process and kill/resume tests.

    python tests/helpers/engine_worker.py OUT_DIR --steps 6 [--zero 2] [--kill-after 3] [--grads] [--then OUT_DIR2 ...]

Rank and world come from RANK/WORLD_SIZE/MASTER_* (a one-process group when unset). Rank 0 writes
`result.pt`: the final weights, the step losses and (with --grads) the
gradient the optimizer saw at the last step.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
from pathlib import Path

# cuBLAS is deterministic only with a fixed workspace; read when its first handle is made
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

if __name__ == "__main__":
    # DeepSpeed's autotuner imports mlflow when installed (3 s of a ~10 s start); this run logs nothing
    sys.modules["mlflow"] = None

import numpy as np
import torch

from alignflow.core.rl.aggregation import aggregate
from alignflow.core.train.engine import Engine
from alignflow.core.spec.settings import TrainSettings

T = 12  # tokens per sequence, so T - 1 log-probs
# where the engine puts the model: the tests' data goes there too (a GPU when there is one)
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


class TinyLM(torch.nn.Module):
    """A bigram language model with a norm: the subprocesses skip importing transformers (seconds)."""

    def __init__(self, vocab: int = 64, dim: int = 32):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.mlp = torch.nn.Linear(dim, dim)
        self.norm = torch.nn.LayerNorm(dim)
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        return self.head(self.norm(h + torch.tanh(self.mlp(h))))


def tiny_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return TinyLM()


def dataset(n: int = 48, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [n, T] and a loss mask [n, T-1] of very uneven lengths (2 to T-1 tokens)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (n, T), generator=g)
    lengths = torch.randint(2, T, (n,), generator=g)
    return ids.to(DEVICE), (torch.arange(T - 1) < lengths[:, None]).float().to(DEVICE)


def per_token_loss(model, ids: torch.Tensor, adv: torch.Tensor) -> torch.Tensor:
    """A policy-gradient-shaped [B, T-1] loss: -log p(token) x a per-sequence advantage."""
    out = model(input_ids=ids)
    logits = getattr(out, "logits", out)[:, :-1].float()
    logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return -logp * adv[:, None]


def grad_capture(engine: Engine) -> dict[str, torch.Tensor]:
    """Fill a dict with the gradients the optimizer sees at each step (ZeRO-0: the full ones)."""
    names = {id(p): n for n, p in engine.module.named_parameters()}
    grads: dict[str, torch.Tensor] = {}

    def hook(opt, args, kwargs):
        for group in opt.param_groups:
            for p in group["params"]:
                grads[names[id(p)]] = p.grad.detach().clone()

    engine.ds.optimizer.register_step_pre_hook(hook)
    return grads


def next_batch(pos: dict, n: int, size: int) -> tuple[torch.Tensor, dict]:
    """The next `size` indices of a per-epoch shuffled order, and the position after them."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(1000 + pos["epoch"]))
    take = order[pos["index"] : pos["index"] + size]
    index = pos["index"] + size
    return take, ({"epoch": pos["epoch"] + 1, "index": 0} if index + size > n else {"epoch": pos["epoch"], "index": index})


def run(out: Path, steps: int = 6, zero: int = 0, micro: int = 4, kill_after: int | None = None, grads: bool = False) -> dict:
    """Train deterministically for `steps` (resuming from `out`); rank 0 gets the result."""
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)  # the same summation order in every process, whatever the CPU count
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    settings = TrainSettings(
        lr=1e-2, lr_scheduler="cosine", warmup_ratio=0.2, weight_decay=0.1, batch_size=8,
        micro_batch_size=micro, grad_clip=1.0, zero_stage=zero, save_every=2,
    )
    engine = Engine.create(tiny_model(), settings, total_steps=steps, out_dir=out, auto_precision="fp32")
    seen = grad_capture(engine) if grads else {}
    ids, mask = dataset()
    pos = engine.data_state or {"epoch": 0, "index": 0}
    losses, norms = [], []
    per_rank = settings.batch_size // engine.world_size
    for _ in engine.steps():
        take, pos = next_batch(pos, len(ids), settings.batch_size)
        # drawn from the global RNG on every rank alike, so a resume must restore it
        adv = torch.randn(settings.batch_size).to(DEVICE)
        mine = torch.arange(engine.rank * per_rank, (engine.rank + 1) * per_rank)
        micros = mine.split(settings.micro_batch_size)
        norm = engine.step_norm([mask[take[m]] for m in micros])
        step_loss = torch.zeros((), device=DEVICE)
        for m in micros:
            loss = aggregate(per_token_loss(engine.model, ids[take[m]], adv[m]), mask[take[m]], "token-mean", norm)
            engine.backward(loss)
            step_loss += loss.detach()
        norms.append(engine.step()["grad_norm"])
        if engine.world_size > 1:
            torch.distributed.all_reduce(step_loss)
        losses.append(step_loss.item())
        engine.maybe_save(pos)
        if engine.step_count == kill_after:
            os.kill(os.getpid(), signal.SIGKILL)
    return {"weights": engine.full_state_dict(), "losses": losses, "grad_norms": norms, "grads": seen}


def run_here(out: Path, **kw) -> dict:
    """`run` inside a test process, leaving torch's global determinism and thread count as they were."""
    deterministic, threads = torch.are_deterministic_algorithms_enabled(), torch.get_num_threads()
    try:
        return run(out, **kw)
    finally:
        torch.use_deterministic_algorithms(deterministic)
        torch.set_num_threads(threads)


def main(argv: list[str]) -> None:
    """Run each `OUT [options]` of argv in turn (separated by `--then`): one process start serves several runs."""
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--zero", type=int, default=0)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--kill-after", type=int)
    ap.add_argument("--grads", action="store_true")
    starts = [0] + [i + 1 for i, arg in enumerate(argv) if arg == "--then"]
    for start, end in zip(starts, [*starts[1:], len(argv) + 1], strict=True):
        a = ap.parse_args(argv[start : end - 1])
        result = run(a.out, a.steps, a.zero, a.micro, a.kill_after, a.grads)
        if torch.distributed.get_rank() == 0:
            torch.save(result, a.out / "result.pt")


if __name__ == "__main__":
    main(sys.argv[1:])
