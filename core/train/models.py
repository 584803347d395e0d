"""Models: the tiny default checkpoint, loading any local or hub model, and per-token helpers.

Value models (PPO critics, reward models) are transformers' `AutoModelForSequenceClassification`
with `num_labels=1`: the standard reward-model checkpoint format, built from any causal LM.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from alignflow.core.train import packing  # a module attribute, so stage digests include its source
from alignflow.core.train.logits import logprobs_and_entropy, logprobs_from_logits
from alignflow.core.train.adapters import ADAPTER_CONFIG, is_adapter_dir
from alignflow.core.train.precision import cpu_has_bf16
from alignflow.core.errors import AlignflowError

log = logging.getLogger(__name__)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

# ~1.0M parameters: learns the bundled task in minutes on a laptop CPU.
TINY_CONFIG: dict[str, Any] = dict(
    hidden_size=128,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=True,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    use_sliding_window=False,
)


def build_tiny(out_dir: Path, seed: int = 0, **overrides: Any) -> Path:
    """Save a tiny Qwen2 model with the character tokenizer to `out_dir`; same seed, same bytes."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from alignflow.core.task.tokenizer import save_char_tokenizer

    out_dir = Path(out_dir)
    tok = save_char_tokenizer(out_dir)
    config = Qwen2Config(
        **{**TINY_CONFIG, **overrides},
        vocab_size=len(tok),
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    with torch.random.fork_rng(devices=[]):  # seed the init without touching the caller's RNG
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(out_dir)
    return out_dir


def _from_pretrained(auto_cls, name_or_path, dtype: str, **kwargs: Any):
    if dtype not in DTYPES:
        raise AlignflowError(f"dtype {dtype!r} is not supported: expected one of {sorted(DTYPES)}")
    if dtype == "bf16" and not torch.cuda.is_available() and not cpu_has_bf16():
        log.warning(
            "dtype bf16 on a CPU without AVX-512 BF16 or AMX (%s): its matmuls run emulated, several times "
            "slower than fp32 (6x for the tiny model)", torch.backends.cpu.get_cpu_capability())
    if is_adapter_dir(name_or_path):
        return _with_merged_adapters(auto_cls, Path(name_or_path), dtype, **kwargs)
    return auto_cls.from_pretrained(str(name_or_path), dtype=DTYPES[dtype], **kwargs)


# -- a folder of LoRA adapters loads as its base model with them merged ----------------------------

def _with_merged_adapters(auto_cls, folder: Path, dtype: str, **kwargs: Any):
    """The adapters' base model (adapter_config.json's `base_model_name_or_path`, `builtin:tiny` rebuilt) with
    the adapters merged into its weights: an ordinary model, as a merged checkpoint would load."""
    import json
    import tempfile

    from peft import PeftModel

    config = json.loads((folder / ADAPTER_CONFIG).read_text())
    base = config.get("base_model_name_or_path")
    if not base:
        raise AlignflowError(f"{folder / ADAPTER_CONFIG}: no base_model_name_or_path, so the model these adapters "
                             "extend is unknown")
    output_info = kwargs.pop("output_loading_info", False)
    with tempfile.TemporaryDirectory() as tmp:
        if base == "builtin:tiny":
            base = build_tiny(Path(tmp), seed=0)
        try:  # a base that is adapters itself (LoRA on a LoRA stage's output) loads merged, recursively
            loaded = _from_pretrained(auto_cls, base, dtype, output_loading_info=output_info, **kwargs)
        except OSError as exc:
            raise AlignflowError(f"{folder / ADAPTER_CONFIG}: cannot load the base model {base!r} these adapters "
                                 f"extend ({exc})") from None
        model, info = loaded if output_info else (loaded, None)
        model = PeftModel.from_pretrained(model, str(folder)).merge_and_unload()
    return (model, info) if output_info else model


def load_model(name_or_path: str | Path, *, dtype: str = "fp32", attn_implementation: str | None = None,
               trust_remote_code: bool = False):
    """A causal LM from a local checkpoint folder or a hub id, ready for `generate`."""
    from transformers import AutoModelForCausalLM

    model = _from_pretrained(AutoModelForCausalLM, name_or_path, dtype,
                             attn_implementation=attn_implementation, trust_remote_code=trust_remote_code)
    gen = model.generation_config
    if gen.pad_token_id is None and gen.eos_token_id is not None:
        eos = gen.eos_token_id
        gen.pad_token_id = eos[0] if isinstance(eos, list) else eos
    return model


def load_value_model(name_or_path: str | Path, *, dtype: str = "fp32",
                     attn_implementation: str | None = None, trust_remote_code: bool = False):
    """A one-output `AutoModelForSequenceClassification`, from a reward model or any causal LM.

    A head missing from the checkpoint (a causal LM's) starts at zero, so initial values are 0.
    """
    from transformers import AutoModelForSequenceClassification

    model, info = _from_pretrained(
        AutoModelForSequenceClassification, name_or_path, dtype, num_labels=1,
        attn_implementation=attn_implementation, trust_remote_code=trust_remote_code,
        output_loading_info=True,
    )
    head = _score_head(model)
    if any(k.startswith("score.") for k in info["missing_keys"]):
        torch.nn.init.zeros_(head.weight)
    if model.config.pad_token_id is None and model.config.eos_token_id is not None:
        eos = model.config.eos_token_id  # the seq-classification forward needs a pad id
        model.config.pad_token_id = eos[0] if isinstance(eos, list) else eos
    return model


def load_tokenizer(name_or_path: str | Path, chat_template: str | None = None, *,
                   padding_side: str = "right", trust_remote_code: bool = False):
    """A tokenizer with a pad token (EOS when it has none); `chat_template` is Jinja or a file."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(name_or_path), trust_remote_code=trust_remote_code)
    tok.padding_side = padding_side
    if tok.pad_token is None:
        if tok.eos_token is None:
            raise AlignflowError(f"tokenizer {name_or_path} has neither a pad nor an eos token")
        tok.pad_token = tok.eos_token
    if chat_template is not None:
        tok.chat_template = chat_template if "{" in chat_template else Path(chat_template).read_text()
    return tok


def position_ids(attention_mask: Tensor) -> Tensor:
    """Positions counted over real tokens only, so left padding does not shift them."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def _score_head(model) -> torch.nn.Module:
    head = getattr(model, "score", None)
    if head is None:
        raise AlignflowError(f"{type(model).__name__} has no `score` head: load it with load_value_model")
    return head


def token_values(model, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
    """Per-token values [B, T] of a value model: the score head on every position."""
    hidden = model.base_model(input_ids, attention_mask=attention_mask,
                              position_ids=position_ids(attention_mask)).last_hidden_state
    return _score_head(model)(hidden).squeeze(-1)


def last_values(values: Tensor, attention_mask: Tensor) -> Tensor:
    """[B, T, ...] per-token values -> [B, ...], each sequence's at its last real token (either padding)."""
    steps = torch.arange(values.shape[1], device=values.device)
    last = (steps * attention_mask.long()).argmax(-1)
    return values[torch.arange(values.shape[0], device=values.device), last]


def sequence_scores(model, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
    """One score per sequence [B]: the value at its last real token, for left or right padding."""
    hidden = model.base_model(input_ids, attention_mask=attention_mask,
                              position_ids=position_ids(attention_mask)).last_hidden_state
    return _score_head(model)(last_values(hidden, attention_mask)).squeeze(-1)


class ValueModel(torch.nn.Module):
    """A value model as one module whose forward gives its values (`token_values`, `sequence_scores`).

    Trainers wrap it in their engine and call the engine (`engine.model(ids, mask)`): DeepSpeed's
    forward hooks the backward prologue that ZeRO-3 needs to accumulate micro-batch gradients, and
    calling the classifier's parts on the engine's inner module gave ZeRO-3 wrong gradients (tested).
    It saves as the plain transformers classifier inside.
    """

    def __init__(self, classifier: torch.nn.Module):
        super().__init__()
        self.classifier = classifier

    def forward(self, input_ids: Tensor, attention_mask: Tensor, last_only: bool = False) -> Tensor:
        """[B, T] values, or with `last_only` [B]: each sequence's at its last real token."""
        if last_only:
            return sequence_scores(self.classifier, input_ids, attention_mask)
        return token_values(self.classifier, input_ids, attention_mask)

    config = property(lambda self: self.classifier.config)

    def save_pretrained(self, out, state_dict: dict[str, Tensor]) -> None:
        prefix = "classifier."
        self.classifier.save_pretrained(out, state_dict={k.removeprefix(prefix): v for k, v in state_dict.items()})


def token_logprobs(model, input_ids: Tensor, attention_mask: Tensor, labels_mask: Tensor | None = None,
                   *, temperature: float = 1.0, return_entropy: bool = False, packed: bool = False):
    """log π(token_t | tokens_<t) at each input position t [B, T]; 0 at t=0 and outside labels_mask.

    Logits are computed only from the first labelled column on (`logits_to_keep`), so a long
    prompt costs no vocabulary-sized memory. With `return_entropy`, also the policy's entropy at
    each position (same alignment, no gradient: a metric), from the same log-softmax. With `packed`, the
    rows' real tokens are packed end to end into as few rows of max(T, PACK_WIDTH) tokens as hold them, rows with
    the same prompt sharing one copy of it (see core/train/packing.py): the same values, without the compute of
    padding and of repeated prompts.
    """
    B, T = input_ids.shape
    mask = attention_mask.bool().clone()
    if labels_mask is not None:
        mask &= labels_mask.bool()
    # A sequence's first real token has no prefix to be predicted from (left padding included).
    mask[:, 0] = False
    mask[:, 1:] &= attention_mask[:, :-1].bool()
    if packed and B > 1 and packing.packing_works(model):
        return packing.packed_token_logprobs(model, input_ids, attention_mask, mask, temperature, return_entropy)
    cols = mask.any(0).nonzero()
    start = int(cols[0]) if len(cols) else T - 1  # first labelled column
    logits = model(input_ids, attention_mask=attention_mask, position_ids=position_ids(attention_mask),
                   logits_to_keep=T - start + 1, use_cache=False).logits[:, :-1]
    if temperature != 1.0:
        logits = logits / temperature
    out = torch.zeros(B, T, dtype=torch.float32, device=input_ids.device)
    if not return_entropy:
        out[:, start:] = logprobs_from_logits(logits, input_ids[:, start:])
        return out.masked_fill(~mask, 0.0)
    ent = torch.zeros_like(out)
    out[:, start:], ent[:, start:] = logprobs_and_entropy(logits, input_ids[:, start:])
    return out.masked_fill(~mask, 0.0), ent.masked_fill(~mask, 0.0)
