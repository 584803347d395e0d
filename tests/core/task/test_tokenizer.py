import random

import pytest
from transformers import AutoTokenizer

from alignflow.core.task import arithmetic as task
from alignflow.core.task.tokenizer import CHAT_TEMPLATE, TAGS, build_char_tokenizer, save_char_tokenizer


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    save_char_tokenizer(path)
    return path


def test_special_token_ids_and_vocab_size():
    tok = build_char_tokenizer()
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    assert len(tok) == 264
    assert [tok.convert_tokens_to_ids(t) for t in TAGS] == [260, 261, 262, 263]


def test_round_trip_on_task_strings():
    tok = build_char_tokenizer()
    rng = random.Random(0)
    for level in task.LEVELS:
        p = task.generate(level, rng)
        text = p.prompt + p.completion()
        ids = tok(text).input_ids
        assert tok.decode(ids) == text
        # One token per character, except that each of the four tags is a single token.
        assert len(ids) == len(text) - sum(len(t) - 1 for t in TAGS)
    # Spaces before punctuation survive (no "clean up"); other characters are their UTF-8 bytes.
    assert tok.decode(tok("a , b .\n").input_ids) == "a , b .\n"
    assert len(tok("é").input_ids) == 2 and tok.decode(tok("é").input_ids) == "é"


def test_tags_survive_skip_special_tokens_but_eos_does_not():
    tok = build_char_tokenizer()
    ids = tok("<think>1+1=2</think><answer>2</answer>").input_ids + [tok.eos_token_id]
    assert tok.decode(ids, skip_special_tokens=True) == "<think>1+1=2</think><answer>2</answer>"
    assert tok.decode(ids).endswith("</answer></s>")


def test_no_special_tokens_added_on_encode():
    tok = build_char_tokenizer()
    assert tok("12+3=").input_ids == tok.convert_tokens_to_ids(list("12+3="))
    assert tok(" ").input_ids == [tok.convert_tokens_to_ids("Ġ")] == [36]  # byte 32, after 4 specials


def test_chat_template_matches_raw_prompt_form():
    tok = build_char_tokenizer()
    user = [{"role": "user", "content": "37+48="}]
    convo = user + [{"role": "assistant", "content": "<answer>85</answer>"}]
    assert tok.apply_chat_template(user, tokenize=False, add_generation_prompt=True) == "37+48="
    assert tok.apply_chat_template(convo, tokenize=False) == "37+48=<answer>85</answer></s>"
    system = [{"role": "system", "content": "Be brief."}] + user
    assert tok.apply_chat_template(system, tokenize=False) == "Be brief.\n37+48="
    ids = tok.apply_chat_template(convo)["input_ids"]
    assert ids[-1] == tok.eos_token_id and ids[-2] == tok.convert_tokens_to_ids("</answer>")


def test_load_from_disk_with_auto_tokenizer(saved):
    tok = AutoTokenizer.from_pretrained(saved)
    ref = build_char_tokenizer()
    text = "905-18=<think>15-8=7</think>"
    assert tok(text).input_ids == ref(text).input_ids
    assert tok.decode(tok("x , y").input_ids) == "x , y"
    assert (tok.pad_token, tok.bos_token, tok.eos_token) == ("<pad>", "<s>", "</s>")
    assert tok.chat_template == CHAT_TEMPLATE
    assert tok.model_max_length == 256


def test_auto_tokenizer_in_a_qwen2_checkpoint_gives_the_same_ids(saved, tmp_path):
    # With a Qwen2 config.json beside it, AutoTokenizer loads through Qwen2Tokenizer, which
    # rebuilds the pre-tokenizer: the ids must not change (spaces were once silently dropped).
    from transformers import Qwen2Config

    for f in saved.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    Qwen2Config(vocab_size=264, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                num_attention_heads=1, num_key_value_heads=1).save_pretrained(tmp_path)
    tok, ref = AutoTokenizer.from_pretrained(tmp_path), build_char_tokenizer()
    text = "S\n37+48=<think>7+8=15 3+4+1=8</think><answer>85</answer></s> é, 'll  x"
    assert tok(text).input_ids == ref(text).input_ids
    assert tok.decode(tok(text).input_ids) == text
    assert tok.eos_token_id == 2 and tok.pad_token_id == 0
