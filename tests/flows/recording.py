"""What a test records: its ranks' calls (`record` and an hf sampler that uses it) and frozen models' forwards.

A module of its own, so that spawned ranks can import the sampler plugin.
"""

import os

import torch
from transformers import Qwen2ForCausalLM

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


class ReferenceForwards:
    """Counts forward passes of frozen causal LMs (the reference: no parameter requires grad)."""

    def __enter__(self):
        self.count = 0

        def hook(module, args, output):
            if isinstance(module, Qwen2ForCausalLM) and not next(module.parameters()).requires_grad:
                self.count += 1

        self.handle = torch.nn.modules.module.register_module_forward_hook(hook)
        return self

    def __exit__(self, *exc):
        self.handle.remove()
