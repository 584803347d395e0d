"""How stage kinds run: which are thread-safe, data-parallel, or depend on the number of ranks."""

from __future__ import annotations

# Stage kinds whose runners touch no process-wide state, so sibling stages may run them at once.
# The others seed and draw from torch's global RNG (model init), share DeepSpeed's process group,
# and import transformers lazily (not thread-safe): in two threads they corrupt each other. So one
# of them at a time runs in this process, and a sibling that starts meanwhile runs in a child
# process (flows/child.py); when it cannot (plugins defined in __main__), it waits its turn.
THREAD_SAFE_KINDS = frozenset({"select"})  # a select stage that scores rows with rewards loads models: not safe
# Stage kinds whose runners split their rows (each step's, or the prompts to sample) over the ranks of
# a process group; `select` runs on one process whatever `--nproc` says.
DATA_PARALLEL_KINDS = frozenset({"sft", "reward_model", "prm", "preference", "rl", "rejection_sampling",
                                 "step_labels", "evaluate"})
# Of those, the kinds whose results depend on the number of ranks beyond float rounding (each rank
# samples its share of the rollouts with its own seed): the number is part of their digest.
RANK_DEPENDENT_KINDS = frozenset({"rl"})
