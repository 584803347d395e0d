"""An agent program written against the `openai` SDK alone that keeps asking until the answer is right: up to 8
tries, each wrong one answered "no. again:". Reward 1 - t/8 for a right answer at try t (0-based), 0 for none; so
an episode lasts 1 to 8 turns and a batch's episodes have a long tail of lengths (the asynchronous RL benchmark,
benchmarks/async_rl.py). As a function: `function: examples/agents/arithmetic_persist.py:agent`.
"""

import os
import re

ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)
TRIES = 8


def agent(client, row: dict, seed: int) -> dict:
    """One episode: up to TRIES model turns; the reward and how many turns it took."""
    model = os.environ.get("OPENAI_MODEL", "policy")
    messages = [{"role": "user", "content": row["prompt"]}]
    for attempt in range(TRIES):
        reply = client.chat.completions.create(model=model, messages=messages, max_tokens=48)
        text = reply.choices[0].message.content or ""
        found = ANSWER.findall(text)
        if found and found[-1].strip() == str(row["answer"]):
            return {"reward": 1.0 - attempt / TRIES, "turns": attempt + 1}
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "\nno. again:\n"}]
    return {"reward": 0.0, "turns": TRIES}
