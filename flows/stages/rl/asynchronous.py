"""Asynchronous rollouts for the `rl` stage: a worker process generates the first round of the next
`max_staleness` (k) steps while the stage scores and trains, as the asynchronous modes of AReaL, verl,
prime-rl, SkyRL, NeMo-RL, OpenRLHF and TRL do.

What is bounded: step s's first round is asked of the worker at step s - k, before that step's update, so every
token of it was sampled by weights published by update s - k or later, and the update of step s uses it: at most k
updates between the weights that sampled a token and the update that learns from it. `async_weights` picks which:
`pinned` generates the round on exactly the weights of its request (k stale; the whole run is a function of the
seed), `latest` on the newest published when the worker starts it, `partial` also switches a generation in flight
to weights published while it decodes (the sampler's `preempt`). The first step, refill rounds and evaluations
generate in the stage's own process on the current weights (staleness 0). The trainer never waits on the
bound: the worker is given a step only once its weights exist, so a round cannot fall outside it.

The trainer publishes each update into a ring of k + 1 shared-memory copies (version v in slot v mod (k + 1));
the oldest slot is rewritten only after the step that needed it has been used, so no copy waits on the worker.
The sampler's log-probs are the behaviour policy's: the algorithm's ratio pi_theta / pi_old is taken against
them (or, with `decoupled`, against a recomputed proximal pi_old, weighting each token by pi_old / mu).
"""

from __future__ import annotations

import copy
import os
import queue
import time
import traceback
from collections import Counter
from dataclasses import dataclass

import torch
import torch.multiprocessing as mp

from alignflow.core import Sampler, seeds
from alignflow.core.errors import AlignflowError
from alignflow.core.train.allocator import keep_freed_memory
from alignflow.flows.stages.rl.rollout import round_share
from alignflow.flows.stages.scoring import CHUNK, prompt_ids


@dataclass(frozen=True)
class Request:
    """One generation round: completions of `prompts` (token ids), or with `episodes` (an `Episodes`)
    multi-turn episodes starting from `prompts` (dataset rows)."""

    prompts: tuple
    n: int
    gen: object
    seed: int
    episodes: object = None

    @classmethod
    def of(cls, prompts, n, gen, seed, episodes=None) -> "Request":
        return cls(tuple(map(tuple, prompts)) if episodes is None else tuple(prompts), n, gen, seed, episodes)

    def run(self, sampler: Sampler, tokenizer):
        if self.episodes is None:
            return sampler.generate([list(p) for p in self.prompts], self.n, self.gen, self.seed)
        return sampler.generate_episodes(self.episodes, tokenizer, list(self.prompts), self.n, self.gen, self.seed)


class Staging:
    """The policy's weights at its last `slots` versions in shared memory, version v in slot v % slots, and the
    newest version published. One lock orders a copy in with a copy out."""

    def __init__(self, model: torch.nn.Module, slots: int, ctx):
        tensors = list(model.state_dict().values())
        self.slots = [[t.detach().clone().share_memory_() for t in tensors] for _ in range(slots)]
        self.newest = ctx.Value("q", 0, lock=False)  # read without the lock: one aligned int64
        self.lock = ctx.Lock()

    def publish(self, model: torch.nn.Module, version: int) -> None:
        with self.lock, torch.no_grad():
            for staged, new in zip(self.slots[version % len(self.slots)], model.state_dict().values()):
                staged.copy_(new)
            self.newest.value = version

    def load(self, model: torch.nn.Module, version: int | None, have: int | None) -> int:
        """Copy `version` (None: the newest) into `model` unless it holds it (`have`); the version it holds."""
        with self.lock, torch.no_grad():
            version = self.newest.value if version is None else version
            if version != have:
                for mine, staged in zip(model.state_dict().values(), self.slots[version % len(self.slots)]):
                    mine.copy_(staged)
        return version


class Preempt:
    """What the worker's sampler asks between decode steps under `async_weights: partial`: whether newer
    weights are published (`due`), and to take them (`refresh`: the version it now holds)."""

    def __init__(self, staging: Staging, model: torch.nn.Module, version: int):
        self.staging, self.model, self.version = staging, model, version

    def due(self) -> bool:
        return self.staging.newest.value != self.version

    def refresh(self) -> int:
        self.version = self.staging.load(self.model, None, self.version)
        return self.version


@dataclass(frozen=True)
class Worker:
    """What the worker process starts from: the stage's sampler class and config, a bare copy of the policy, the
    tokenizer, its torch threads and the `async_weights` mode."""

    sampler_cls: type
    config: object
    template: torch.nn.Module
    tokenizer: object
    threads: int
    mode: str


def _worker(setup: Worker, staging, requests, results) -> None:
    torch.set_num_threads(setup.threads)
    keep_freed_memory()  # as the stage's process does on a CPU (the worker runs on a CPU only)
    model, tokenizer, mode = setup.template.eval(), setup.tokenizer, setup.mode
    sampler = setup.sampler_cls(setup.config)
    sampler.load(model, tokenizer)
    version, idle_from, parent = 0, time.perf_counter(), os.getppid()
    while (item := _next(requests, parent)) is not None:
        want, request = item
        idle = time.perf_counter() - idle_from
        version = staging.load(model, want, version)
        if mode == "partial":  # the sampler may switch to newer weights mid-generation (hf's `preempt`)
            sampler.preempt = Preempt(staging, model, version)
        try:
            start = time.perf_counter()
            g = request.run(sampler, tokenizer)
            g.timings["worker_generate_s"] = time.perf_counter() - start
            results.put((request, version, g, None, idle))
        except Exception:  # noqa: BLE001 - reported in the stage's process
            results.put((request, version, None, traceback.format_exc(), idle))
        if mode == "partial":
            version = sampler.preempt.version
        idle_from = time.perf_counter()


def _next(requests, parent: int):
    """The next request; None once the stage's process is gone (one killed sends no None, and the worker must not
    outlive it)."""
    while True:
        try:
            return requests.get(timeout=1)
        except queue.Empty:
            if os.getppid() != parent:
                return None


def bare_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of the module without the hooks an engine put on it (DeepSpeed's cannot be pickled)."""
    out = copy.deepcopy(model).eval()
    for m in out.modules():
        for name, value in vars(m).items():
            if name.startswith("_") and "hooks" in name and isinstance(value, dict):
                value.clear()
    return out


class AsyncRollouts(Sampler):
    """Wraps the stage's sampler: `submit` gives the worker a request on the weights published so far; `generate`
    of the oldest request submitted returns its answer (`generate_s` is the wait), any other request generates
    here on the current weights. `take_metrics` gives the staleness and idle times since it was last called."""

    online = True

    def __init__(self, inner: Sampler, model: torch.nn.Module, tokenizer, threads: int = 1, staleness: int = 1,
                 weights: str = "pinned"):
        super().__init__(inner.config)
        self.inner, self.mode = inner, weights
        ctx = mp.get_context("spawn")
        self.staging = Staging(model, staleness + 1, ctx)
        self.requests, self.results = ctx.Queue(), ctx.Queue()
        self.process = ctx.Process(target=_worker, daemon=True, name="alignflow-rollouts",
                                   args=(Worker(type(inner), inner.config, bare_copy(model), tokenizer, threads,
                                                weights), self.staging, self.requests, self.results))
        self.process.start()
        self.version = 0  # updates published so far
        self.pending: list[Request] = []  # submitted, in the order the worker answers them
        self.lags: Counter = Counter()  # samples per staleness, since `take_metrics`
        self.tokens: Counter = Counter()  # generated tokens per staleness
        self.waited = self.idle = 0.0
        self.interrupted = 0  # samples whose generation switched weights (`partial`)

    def load(self, model, tokenizer) -> None:
        self.inner.load(model, tokenizer)

    def submit(self, prompts, n, gen, seed, episodes=None) -> None:
        """Start a round in the worker: completions of token-id `prompts`, or `episodes` from row `prompts`."""
        self.pending.append(Request.of(prompts, n, gen, seed, episodes))
        self.requests.put((self.version if self.mode == "pinned" else None, self.pending[-1]))

    def generate(self, prompt_ids, n, gen, seed):
        return self._answer(Request.of(prompt_ids, n, gen, seed))

    def generate_episodes(self, episodes, tokenizer, rows, n, gen, seed):
        return self._answer(Request.of(rows, n, gen, seed, episodes), tokenizer)

    def _answer(self, request: Request, tokenizer=None):
        """The worker's answer if `request` is the oldest one it was given, else generated here."""
        if not self.pending or request != self.pending[0]:
            g = request.run(self.inner, tokenizer)
            self.count(g, self.version)
            return g
        start = time.perf_counter()
        request, version, g, error, idle = self._get()
        if request != self.pending.pop(0):
            raise AlignflowError("asynchronous rollouts: the worker answered another request than the one asked for")
        if error is not None:
            raise AlignflowError(f"asynchronous rollouts: the worker failed:\n{error}")
        g.timings["generate_s"] = wait = time.perf_counter() - start
        self.waited, self.idle = self.waited + wait, self.idle + idle
        self.count(g, version)
        return g

    def count(self, g, version: int) -> None:
        """Each sample's staleness (that of its oldest token) and each token's, `version` where `g` has none."""
        for row in g.versions or [[version] * len(c) for c in g.completion_ids]:
            self.lags[self.version - min(row, default=version)] += 1
            self.tokens.update(self.version - v for v in row)
            self.interrupted += len(set(row)) > 1

    def take_metrics(self) -> dict[str, float]:
        """Since the last call: the most and the mean updates between a sample's weights and these, the share
        of samples at each staleness and of tokens, the samples whose generation switched weights, the time the
        stage waited for the worker and the worker for a request. Samples generated here count as staleness 0."""
        lags, tokens = self.lags, self.tokens
        n, total = sum(lags.values()), sum(tokens.values())
        out = {"rollout/staleness": float(max(lags, default=0)),
               "rollout/staleness_mean": sum(k * v for k, v in lags.items()) / max(n, 1),
               "rollout/interrupted": float(self.interrupted),
               "time/rollout_wait": self.waited, "time/worker_idle": self.idle,
               **{f"rollout/staleness_share/{k}": v / n for k, v in sorted(lags.items())},
               **{f"rollout/token_share/{k}": v / total for k, v in sorted(tokens.items())}}
        self.lags, self.tokens, self.waited, self.idle, self.interrupted = Counter(), Counter(), 0.0, 0.0, 0
        return out

    def update_weights(self, model) -> None:
        """Publish the new weights (the slot they take held a version no request still needs)."""
        self.inner.update_weights(model)
        self.version += 1
        self.staging.publish(model, self.version)

    def _get(self):
        while True:
            try:
                return self.results.get(timeout=5)
            except queue.Empty:  # check the worker is alive, then wait on
                if not self.process.is_alive():
                    raise AlignflowError(f"asynchronous rollouts: the worker process died "
                                         f"(exit code {self.process.exitcode})") from None

    def release(self) -> None:
        self.inner.release()

    def close(self) -> None:
        if self.process.is_alive():
            self.requests.put(None)
            self.process.join(timeout=30)
            if self.process.is_alive():
                self.process.kill()
        self.inner.close()


def start_async(ctx, p, first: int, total: int) -> None:
    """At the stage's start (`first`, a resumed run's first step): give the worker steps first + 1 .. first + k - 1
    (step first + k follows once step `first` has drawn its rollout, as every later one does)."""
    if isinstance(p.sampler, AsyncRollouts):
        for step in range(first + 1, min(first + ctx.settings.max_staleness, total)):
            submit(ctx, p, step)


def async_next(ctx, p, step: int, total: int) -> dict[str, float]:
    """The step's asynchronous metrics, after giving the worker step + k (the weights this step trains exist)."""
    if not isinstance(p.sampler, AsyncRollouts):
        return {"rollout/staleness": 0.0}
    metrics = p.sampler.take_metrics()
    if step + ctx.settings.max_staleness < total:
        submit(ctx, p, step + ctx.settings.max_staleness)
    return metrics


def submit(ctx, p, step: int) -> None:
    """Give the worker `step`'s first generation round: the same calls `collect` makes."""
    index, mine, seed = round_share(ctx, step, 0, p.dataset, p.prompts, keep=True)
    rows = [p.dataset[index[i]] for i in mine]
    prompts = rows if p.episodes is not None else prompt_ids(p.tokenizer, rows)  # episodes start from rows
    for lo in range(0, len(prompts), CHUNK):
        p.sampler.submit(prompts[lo: lo + CHUNK], ctx.settings.group_size, ctx.settings.generation,
                         seeds.chunk(seed, lo), p.episodes)
