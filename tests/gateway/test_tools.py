"""Tool calls: a reply that writes Hermes-style `<tool_call>` blocks comes back to the official
`openai` client as `message.tool_calls`; the agent's next request (the assistant message with its
tool calls echoed, then the tool's result) goes on in the same token-exact trajectory, whose
sampled tokens are the reply as written, blocks included.

No model that runs here writes tool calls, so the generation server is a stand-in: `Scripted`
answers each turn with the token ids of a fixed reply (named as the fake it is); the tokenizer,
the chat template, the HTTP endpoint and the client are the real ones."""

import json

import openai
import pytest

from services.agents.handler import TurnHandler
from services.agents.routes import build_app
from services.agents.session_store import Sessions
from services.agents.tools import parse_tool_calls, same_calls
from services.common.lifecycle import HTTPServerThread
from services.common.model_files import load_tokenizer
from services.common.types import Completion, GenerationResult

CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}},
        },
    }
]


def test_hermes_blocks_are_parsed_and_anything_else_is_content():
    content, calls = parse_tool_calls("Let me add.\n" + CALL)
    assert content == "Let me add."
    assert [c["function"]["name"] for c in calls] == ["add"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"a": 2, "b": 3} and calls[0]["type"] == "function"
    assert parse_tool_calls("no call here") == ("no call here", [])
    broken = "<tool_call>{not json}</tool_call>"
    assert parse_tool_calls(broken) == (broken, [])  # not a well-formed call: plain content
    echoed = [{"id": "x", "type": "function", "function": {"name": "add", "arguments": '{"b":3,"a":2}'}}]
    assert same_calls(echoed, calls) and not same_calls([], calls)


class Scripted:
    """A stand-in for the generation server (a fake: no model here writes tool calls): each call
    answers the next reply of `replies` as token ids, and records the prompts it was sent."""

    def __init__(self, tok, replies: list[str]):
        self.tok, self.replies, self.prompts = tok, list(replies), []

    def generate(self, session, prompt, params, first, cancel=None):
        self.prompts.append(list(prompt))
        ids = self.tok(self.replies.pop(0), add_special_tokens=False)["input_ids"]
        return GenerationResult([[Completion(ids, [-0.5] * len(ids), "stop")]], 7, len(ids), 0.0)


@pytest.fixture
def endpoint(tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    sampler = Scripted(tok, [CALL, "the sum is 5."])
    gateway = TurnHandler(tok, sampler, Sessions(), "tiny", 256, 1)
    http = HTTPServerThread(build_app(gateway, None), "127.0.0.1", 0, name="tools-test")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{http.start()}/v1", api_key="unused", max_retries=0)
    yield client, gateway, sampler, tok
    http.stop()


def test_a_tool_call_and_its_result_stay_in_one_token_exact_trajectory(endpoint):
    client, gateway, sampler, tok = endpoint
    session = {"x-session-id": "tools-1"}
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    first = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, extra_headers=session)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 2, "b": 3}
    # the agent runs the tool and sends the result back, echoing the assistant message as it got it
    messages += [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "5"},
    ]
    second = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, extra_headers=session)
    assert second.choices[0].message.content == "the sum is 5." and second.choices[0].finish_reason == "stop"
    (traj,) = gateway.sessions.find("tools-1").record()["trajectories"]  # one segment: it went on
    assert traj["turns"] == 2 and traj["policy_versions"] == [7, 7]
    ids, mask = traj["token_ids"], traj["loss_mask"]
    runs = [(m, tok.decode([t for t, k in zip(ids, mask) if k == m])) for m in (1,)]
    assert runs[0][1] == CALL + "the sum is 5."  # the sampled tokens: the reply as written, blocks included
    second_prompt = sampler.prompts[1]
    assert second_prompt == ids[: len(second_prompt)]  # the second turn saw the first's tokens as sampled
    environment = tok.decode(
        [t for t, k in zip(ids[len(sampler.prompts[0]) :], mask[len(sampler.prompts[0]) :]) if k == 0]
    )
    assert "5" in environment and "add" not in environment  # the tool's result, not the call rendered again
