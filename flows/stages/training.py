"""What the training stages share: model inputs, plugin instances, data order and saving."""

from __future__ import annotations

import math
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch

from alignflow.core import seeds
from alignflow.core.errors import SpecError
from alignflow.core.train.adapters import has_adapters, with_lora
from alignflow.core.train.models import ValueModel, build_tiny, load_model, load_tokenizer, load_value_model
from alignflow.flows.stages import StageContext

BUILTIN = "builtin:"


@contextmanager
def model_source(ctx: StageContext, key: str = "model") -> Iterator[str]:
    """A model input as something `from_pretrained` loads; `builtin:tiny` is built on the fly."""
    value = ctx.inputs[key]
    if isinstance(value, str) and value.startswith(BUILTIN):
        name = value[len(BUILTIN):]
        if name != "tiny":
            raise SpecError(f"stage {ctx.name!r}, inputs.{key}: unknown built-in model {name!r} (known: tiny)")
        with tempfile.TemporaryDirectory() as tmp:
            yield str(build_tiny(Path(tmp), seed=0))
        return
    yield str(value)


def load_tokenizer_for(ctx: StageContext, src):
    """The stage's tokenizer, with `settings.model` options (chat template, remote code)."""
    o = ctx.settings.model
    return load_tokenizer(src, o.chat_template, trust_remote_code=o.trust_remote_code)


def load_model_for(ctx: StageContext, src, *, value_head: bool = False, dtype: str | None = None):
    """A causal LM with `settings.model` options and the stage's weight dtype (bf16 only for `precision: bf16`);
    with `value_head`, a one-output value model to train, as a `ValueModel` (its forward, run by the engine,
    gives the values)."""
    o = ctx.settings.model
    loader = load_value_model if value_head else load_model
    model = loader(src, dtype=dtype or getattr(ctx.settings, "weight_dtype", "fp32"),
                   attn_implementation=o.attn_implementation, trust_remote_code=o.trust_remote_code)
    return ValueModel(model) if value_head else model


def load_policy(ctx: StageContext, src):
    """The causal LM a stage trains: with `settings.lora.r` > 0, wrapped in LoRA adapters, the only weights that
    train (their base recorded as the stage's `model` input, for loading the saved adapters back)."""
    model = load_model_for(ctx, src)
    return with_lora(model, ctx.settings.lora, ctx.inputs["model"], ctx.seed) if lora_rank(ctx.settings) else model


def lora_rank(settings) -> int:
    """`settings.lora.r`: 0 when LoRA is off or the settings have no `lora` block."""
    lora = getattr(settings, "lora", None)
    return lora.r if lora is not None else 0


def total_steps(n_rows: int, settings) -> int:
    """Optimizer steps: `max_steps`, or `epochs` passes over the rows in whole batches."""
    if settings.max_steps is not None:
        return settings.max_steps
    per_epoch = n_rows // settings.batch_size
    if per_epoch == 0:
        raise SpecError(f"batch_size={settings.batch_size} is larger than the dataset ({n_rows} rows)")
    return max(1, math.ceil(settings.epochs * per_epoch))


def step_rows(step: int, n_rows: int, batch_size: int, seed: int) -> list[int]:
    """Row indices of optimizer step `step`: a fresh seeded permutation per epoch, whole batches only.

    A pure function of the step, so a resumed run draws exactly the rows an uninterrupted run would.
    """
    per_epoch = n_rows // batch_size
    epoch, index = divmod(step, per_epoch)
    order = torch.randperm(n_rows, generator=seeds.generator(seeds.epoch_order(seed, epoch)))
    return order[index * batch_size: (index + 1) * batch_size].tolist()


def micro_slices(rows: list[int], micro: int) -> list[list[int]]:
    return [rows[i: i + micro] for i in range(0, len(rows), micro)]


def save_pretrained(engine, tokenizer, out: Path) -> Path:
    """The trained weights as an ordinary transformers checkpoint (gathered under ZeRO-3).

    A LoRA policy saves its adapters (peft's adapter_config.json + adapter_model.safetensors): as `out` itself,
    which loads as the base plus them (core.models.load_model), or with `lora.merge` in `out/adapter`, `out`
    then holding the merged model, built by loading those adapters back onto their base as a later stage would.
    """
    state = engine.full_state_dict()
    if engine.rank == 0:
        adapters = has_adapters(engine.module)
        merge = adapters and engine.settings.lora.merge
        first = out / "adapter" if merge else out
        engine.module.save_pretrained(first, state_dict=state)  # a peft model keeps only the adapter weights
        tokenizer.save_pretrained(first)
        if merge:
            o = engine.settings.model
            merged = load_model(first, dtype=engine.settings.weight_dtype,
                                attn_implementation=o.attn_implementation, trust_remote_code=o.trust_remote_code)
            merged.save_pretrained(out)
            tokenizer.save_pretrained(out)
    return out
