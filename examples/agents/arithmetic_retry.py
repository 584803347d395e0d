"""An agent program written against the `openai` SDK alone: it asks the policy an arithmetic question, checks the
answer it gets, and gives one more try with a hint when it is wrong. Reward 1 for a right first answer, 0.5 for
a right second one.

As a command (`openai_agent` with `command: [python, examples/agents/arithmetic_retry.py]`) it reads the row from
ALIGNFLOW_ROW and prints `{"reward": ...}`; as a function (`function: examples/agents/arithmetic_retry.py:agent`)
the stage calls `agent(client, row, seed)` with an `openai.OpenAI` client. Against any OpenAI-compatible server:
`OPENAI_BASE_URL=... ALIGNFLOW_ROW='{"prompt": "12+34=", "answer": "46"}' python arithmetic_retry.py`.
"""

import json
import os
import re

ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)
TRIES = 2


def agent(client, row: dict, seed: int) -> dict:
    """One episode: up to TRIES model turns; the reward and how many turns it took."""
    model = os.environ.get("OPENAI_MODEL", "policy")
    messages = [{"role": "user", "content": row["prompt"]}]
    for attempt in range(TRIES):
        reply = client.chat.completions.create(model=model, messages=messages, max_tokens=48)
        text = reply.choices[0].message.content or ""
        found = ANSWER.findall(text)
        if found and found[-1].strip() == str(row["answer"]):
            return {"reward": 1.0 if attempt == 0 else 0.5, "turns": attempt + 1}
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "\nno. again:\n"}]
    return {"reward": 0.0, "turns": TRIES}


if __name__ == "__main__":
    from openai import OpenAI

    with OpenAI(max_retries=0) as openai_client:
        print(json.dumps(agent(openai_client, json.loads(os.environ["ALIGNFLOW_ROW"]), int(os.environ.get("ALIGNFLOW_SEED", 0)))))
