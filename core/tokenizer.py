"""The character-level tokenizer of the tiny default model, as a `PreTrainedTokenizerFast`.

Every printable ASCII character and newline is one token. The R1 tags are single added tokens:
a level-1 completion is then ~20 tokens instead of ~48, which fits RL's generation budget, and
the tiny model cannot misspell a tag; they are not "special", so `decode(...,
skip_special_tokens=True)` keeps them for the format and accuracy rewards.
"""

from __future__ import annotations

import string
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)  # ids 0..3, in this order
TAGS = ("<think>", "</think>", "<answer>", "</answer>")
CHARS = "\n" + string.printable[:95]  # digits, letters, punctuation, space

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
    """A fresh character tokenizer: 4 special tokens, 96 characters, 4 tag tokens (104 ids)."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + tuple(CHARS))}
    # BPE with no merges is exactly "one token per character", with an <unk> fallback.
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    core.decoder = decoders.Fuse()  # join characters without inserting spaces
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
