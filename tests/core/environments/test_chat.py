"""Token-in, token-out transcripts: sampled ids kept as sampled, replies tokenised once, templates checked."""

import json

import pytest

from alignflow.core.environments.chat import TemplateError, Transcript, render, row_tools
from alignflow.core.task.tokenizer import build_char_tokenizer

# Qwen2.5's shape: each turn `<role>\ncontent` + EOS + "\n"; tool results inside <tool_response> as a user turn
QWEN_LIKE = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'tool' -%}{{ '[user]\n<tool_response>' + m.content + '</tool_response>' + eos_token + '\n' }}"
    "{%- else -%}{{ '[' + m.role + ']\n' + m.content + eos_token + '\n' }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '[assistant]\n' }}{%- endif -%}")
# drops earlier assistant turns' text, as templates that strip earlier reasoning do
FORGETFUL = QWEN_LIKE.replace("{{ '[' + m.role + ']\n' + m.content + eos_token + '\n' }}",
                              "{{ '[' + m.role + ']\n' + ('...' if m.role == 'assistant' and not loop.last "
                              "else m.content) + eos_token + '\n' }}")


def tokenizer(template):
    tok = build_char_tokenizer(1024)
    tok.chat_template = template
    return tok


def sampled(tok, text):
    """A turn as a sampler returns it: its tokens and the stop token."""
    return tok(text, add_special_tokens=False).input_ids + [tok.eos_token_id]


def test_three_turns_keep_the_sampled_ids_and_tokenise_each_reply_once():
    tok = tokenizer(QWEN_LIKE)
    t = Transcript(tok, [{"role": "user", "content": "2+3*4?"}])
    assert tok.decode(t.prompt_ids) == "[user]\n2+3*4?</s>\n[assistant]\n"
    turns = ["<call>calculator 3*4</call>", "<call>calculator 2+12</call>", "<answer>14</answer>"]
    for i, text in enumerate(turns):
        ids = sampled(tok, text)
        t.add_turn(ids, [-0.5] * len(ids), text)
        if i < 2:
            reply = [{"role": "tool", "content": ["12", "14"][i]}]
            t.add_reply(reply, t.reply_ids(reply))
    # the whole transcript is the template's rendering of the conversation (but the newline after the last
    # stop token, which no one samples), with the model's turns as sampled
    assert tok.decode(t.prompt_ids + t.ids) + "\n" == render(tok, t.messages, None, False)
    model = [tok.decode([x for x, m in zip(t.ids, t.mask) if m])]
    assert model == ["".join(x + "</s>" for x in turns)]
    reply = tok.decode([x for x, m in zip(t.ids, t.mask) if not m])
    # the newline the template puts after the stop token belongs to the reply (context, no loss)
    assert reply == ("\n[user]\n<tool_response>12</tool_response></s>\n[assistant]\n"
                     "\n[user]\n<tool_response>14</tool_response></s>\n[assistant]\n")
    assert [lp for lp, m in zip(t.logprobs, t.mask) if not m] == [0.0] * t.mask.count(0)
    assert all(lp == -0.5 for lp, m in zip(t.logprobs, t.mask) if m)


def test_the_tiny_template_appends_the_reply_text_alone():
    tok = build_char_tokenizer()
    t = Transcript(tok, [{"role": "user", "content": "7*8="}])
    assert t.prompt_ids == tok("7*8=").input_ids  # as the single-turn stages tokenise the prompt
    t.add_turn(sampled(tok, "<call>calculator 7*8</call>"), None, "<call>calculator 7*8</call>")
    reply = [{"role": "tool", "content": "<result>56</result>"}]
    assert tok.decode(t.reply_ids(reply)) == "<result>56</result>"


def test_a_template_that_rewrites_earlier_turns_is_refused():
    tok = tokenizer(FORGETFUL)
    t = Transcript(tok, [{"role": "user", "content": "hi"}])
    t.add_turn(sampled(tok, "thinking"), None, "thinking")
    with pytest.raises(TemplateError, match="renders earlier turns differently once turn 1 is added"):
        t.reply_ids([{"role": "user", "content": "go on"}])


def test_row_tools_keep_a_json_strings_nulls_and_drop_the_ones_arrow_fills_in():
    schema = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "integer", "default": None}}}}}
    assert row_tools(json.dumps([schema])) == [schema]  # written as JSON: exactly as written, its null too
    filled = {"type": "function", "function": {"name": "g", "description": None, "parameters": {
        "type": "object", "properties": {"x": {"type": "integer", "default": None}, "y": None}}}}
    assert row_tools([filled]) == [{"type": "function", "function": {"name": "g", "parameters": {
        "type": "object", "properties": {"x": {"type": "integer"}}}}}]  # a list as Arrow gives it: nulls dropped
    assert row_tools(None) is None and row_tools([]) is None and row_tools("[]") is None
    for bad in ("5", '{"name": "f"}'):
        with pytest.raises(TypeError, match="expected a list"):
            row_tools(bad)
