"""The character-level tokenizer of the tiny default model, as a `PreTrainedTokenizerFast`.

Byte-level BPE with no merges: each ASCII character is one token, any other byte one token
each, so nothing is ever unknown. It is the pipeline `Qwen2Tokenizer` builds, because
`AutoTokenizer` loads a Qwen2 checkpoint's tokenizer through that class whatever the
tokenizer config says; both classes thus give the same ids. The R1 tags are single added
tokens: a level-1 completion is ~20 tokens instead of ~48, which fits RL's generation budget,
and the tiny model cannot misspell a tag. They are not "special", so `decode(...,
skip_special_tokens=True)` keeps them for the format and accuracy rewards.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)  # ids 0..3, in this order
TAGS = ("<think>", "</think>", "<answer>", "</answer>")
# Qwen2Tokenizer's split; with no merges it changes no ids, but keeps the two pipelines identical.
SPLIT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""


def byte_symbols() -> list[str]:
    """GPT-2's byte -> printable-character map, in byte order: printable bytes stand for themselves."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(shifted)) for b in range(256)]


# Messages are concatenated as they are, so the chat form of a task prompt is the raw prompt
# ("37+48="), identical to the prompt/completion form; each assistant turn ends with EOS.
CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'system' -%}{{ m['content'] + '\n' }}"
    "{%- elif m['role'] == 'assistant' -%}{{ m['content'] + eos_token }}"
    "{%- else -%}{{ m['content'] }}"
    "{%- endif -%}"
    "{%- endfor -%}"
)


def build_char_tokenizer(model_max_length: int = 256) -> PreTrainedTokenizerFast:
    """A fresh tokenizer: 4 special tokens (ids 0-3), 256 bytes, 4 tag tokens (264 ids)."""
    vocab = {tok: i for i, tok in enumerate([*SPECIAL_TOKENS, *byte_symbols()])}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.normalizer = normalizers.NFC()
    core.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    core.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAGS])
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        chat_template=CHAT_TEMPLATE,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,  # its default would rewrite "a , b" as "a, b"
    )


def save_char_tokenizer(out_dir: Path, model_max_length: int = 256) -> PreTrainedTokenizerFast:
    """Build the character tokenizer and `save_pretrained` it into `out_dir`."""
    tok = build_char_tokenizer(model_max_length)
    tok.save_pretrained(str(out_dir))
    return tok
