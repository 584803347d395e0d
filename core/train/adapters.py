"""LoRA adapters (peft): wrapping a model, the weights a sampler syncs, saving them, the reference.

A LoRA stage trains only the adapters; its reference is the same model with them switched off
(`AdaptersOff`), and its `model` output is adapters (`save_adapters`) or a merged checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from alignflow.core.errors import AlignflowError

ADAPTER_CONFIG = "adapter_config.json"  # peft's: what makes a folder adapters rather than a whole model


def is_adapter_dir(name_or_path) -> bool:
    """Whether a model input is a folder of peft adapters (a LoRA stage's `model` output without merge)."""
    return (Path(str(name_or_path)) / ADAPTER_CONFIG).is_file()


def with_lora(model, lora, base_name: str, seed: int = 0):
    """`model` wrapped in peft's LoRA adapters as `lora` (core.settings.LoraSettings) says; only they train.
    `base_name` is recorded as the adapters' base (adapter_config.json), for loading them back. A's random init
    is drawn from `seed` (the caller's RNG untouched): the same stage starts from the same adapters."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=lora.r, lora_alpha=lora.alpha or lora.r, lora_dropout=lora.dropout,
                        target_modules=lora.target_modules, task_type="CAUSAL_LM")
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            peft_model = get_peft_model(model, config)
    except ValueError as exc:  # e.g. target_modules matching no module
        raise AlignflowError(f"settings.lora.target_modules={lora.target_modules!r}: {exc}") from None
    peft_model.peft_config["default"].base_model_name_or_path = str(base_name)
    if (tied := tied_adapter(peft_model)) is not None:
        raise AlignflowError(f"settings.lora.target_modules={lora.target_modules!r}: adapters on {tied!r} adapt the "
                             "matrix the model ties between its input embeddings and output head "
                             "(tie_word_embeddings): one matrix in a checkpoint cannot hold the two; leave "
                             f"{tied.rsplit('.', 1)[-1]!r} out")
    return peft_model


def tied_adapter(model) -> str | None:
    """The name of a LoRA layer on a matrix the model ties between input embeddings and output head, or None.
    Such adapters change one use of the matrix and not the other: no merged checkpoint holds that policy."""
    from peft.tuners.lora import LoraLayer

    base = getattr(model, "module", model).get_base_model()
    if not getattr(base.config, "tie_word_embeddings", False):
        return None
    tied = {base.get_input_embeddings(), base.get_output_embeddings()}
    for name, layer in base.named_modules():
        if isinstance(layer, LoraLayer) and (layer in tied or layer.get_base_layer() in tied):
            return name
    return None


def has_adapters(model) -> bool:
    """Whether `model` (or a DeepSpeed engine's module) is a peft model with adapters."""
    return hasattr(getattr(model, "module", model), "disable_adapter")


def merged_state_dict(model) -> dict[str, Tensor]:
    """A peft LoRA model's weights under its base model's own names, each adapted weight W as W + its adapters'
    deltas (peft's `get_delta_weight`: (alpha / r) B A); the module itself is left as it is (merging in place and
    back would move the base weights by the rounding of W + d - d on every call)."""
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    deltas: dict[str, Tensor] = {}
    for name, layer in base.named_modules():
        if isinstance(layer, LoraLayer) and not layer.merged:
            for adapter in layer.active_adapters:
                if adapter in layer.lora_A:
                    delta = layer.get_delta_weight(adapter)
                    key = f"{name}.weight"
                    deltas[key] = deltas[key] + delta if key in deltas else delta
    return {key: value + deltas[key].to(value.dtype) if key in deltas else value
            for key, value in base_state_dict(model).items()}


def base_state_dict(model) -> dict[str, Tensor]:
    """A peft LoRA model's base weights W under its base model's own names, the adapters left out."""
    state = getattr(model, "module", model).get_base_model().state_dict()
    return {key.replace(".base_layer.", "."): value for key, value in state.items() if ".lora_" not in key}


def save_adapters(model, folder: Path) -> Path:
    """A peft model's adapters as peft's `save_pretrained` lays them out (adapter_config.json and
    adapter_model.safetensors: A and B of each adapted module), and nothing else: no full embedding matrices
    (`save_pretrained`'s default asks the Hugging Face Hub whether the base's vocabulary was resized) and no
    model card. A folder that `PeftModel.from_pretrained` and vLLM's `LoRARequest` both load."""
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file

    peft_model = getattr(model, "module", model)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = get_peft_model_state_dict(peft_model, save_embedding_layers=False)
    save_file({k: v.detach().to("cpu", copy=True).contiguous() for k, v in state.items()},
              str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    peft_model.peft_config["default"].save_pretrained(str(folder))
    return folder


class AdaptersOff(torch.nn.Module):
    """The base model under a peft policy, as a reference: its forward is the policy's with the adapters
    switched off (`disable_adapter`), so the reference costs no second copy of the weights. The policy is held
    outside the module tree: nothing may freeze, move or save it through this wrapper (`parameters()` lists the
    policy's, for what reads the dtype or device from them)."""

    def __init__(self, policy):
        super().__init__()
        self._policy = (policy,)

    @property
    def module(self):
        """The policy module (packing probes its class, which shares the base's attention)."""
        return self._policy[0]

    config = property(lambda self: self.module.config)
    device = property(lambda self: self.module.device)

    def parameters(self, recurse: bool = True):
        return self.module.parameters(recurse)

    def forward(self, *args, **kwargs):
        policy = self.module
        training = policy.training
        policy.eval()  # as a frozen reference would be: no dropout
        try:
            with policy.disable_adapter():
                return policy(*args, **kwargs)
        finally:
            policy.train(training)
