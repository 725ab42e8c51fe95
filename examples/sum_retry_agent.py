"""A two-try agent for `rollout.agent` (configs/smollm2-agent.yaml): the policy is asked a sum;
when its answer is wrong the environment says so and asks again. Reward: 1 for the right answer
at the first try, 0.5 at the second, 0 otherwise (the answer is the last number of a reply).

The policy's two replies are trained on (mask 1); the environment's words between them are in
its context only (mask 0). Run it:

    rlhf up -c configs/smollm2-agent.yaml
    rlhf eval -c configs/smollm2-agent.yaml --baseline runs/smollm2-135m --model runs/smollm2-agent/final
"""

import re

RETRY = "That is not right. Add the two numbers again and answer with the number only."
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def answer(reply: str) -> str | None:
    """The last number in a reply (commas between digits dropped), or None."""
    found = NUMBER.findall(re.sub(r"(?<=\d),(?=\d{3})", "", reply or ""))
    return found[-1] if found else None


def run(client, sample) -> float:
    """`client`: an openai.OpenAI bound to this sample's session; `sample`: its prompt record."""
    messages = [{"role": "user", "content": sample.prompt}]
    for reward in (1.0, 0.5):
        reply = client.chat.completions.create(model="policy", messages=messages, max_tokens=24)
        text = reply.choices[0].message.content or ""
        if answer(text) == str(sample.label).strip():
            return reward
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": RETRY}]
    return 0.0
