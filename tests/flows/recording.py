"""What a data-parallel test records of its ranks' calls: `record` and an hf sampler that uses it.

A module of its own, so that spawned ranks can import the sampler plugin.
"""

import os

import alignflow.plugins.hf
from alignflow.core import hookimpl


def record(call: str) -> None:
    """Note a call and the rank making it in $CALLS_FILE, when set (children inherit it)."""
    if "CALLS_FILE" in os.environ:
        with open(os.environ["CALLS_FILE"], "a") as f:
            f.write(f"{os.environ.get('RANK', '0')} {call}\n")


class CountingHF(alignflow.plugins.hf.HFSampler):
    """The hf sampler, noting each call's rank and prompt count (`record`)."""

    def generate(self, prompt_ids, n, gen, seed):
        record(f"generate {len(prompt_ids)}")
        return super().generate(prompt_ids, n, gen, seed)


class Samplers:
    @staticmethod
    @hookimpl
    def register_samplers(register):
        register("counting_hf", CountingHF)
