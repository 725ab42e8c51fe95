"""Tool calls in a reply, written the way Hermes-style chat templates (Qwen2.5, Hermes, SmolLM3
and others that render `tools`) ask a model to: one block per call,

    <tool_call>
    {"name": "add", "arguments": {"a": 2, "b": 3}}
    </tool_call>

returned as OpenAI's `message.tool_calls` (the text outside the blocks is the `content`). The
session keeps the tokens the policy sampled, blocks included; a reply whose blocks are not all
well-formed calls is plain content."""

from __future__ import annotations

import hashlib
import json
import re

BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def parse_tool_calls(text: str) -> tuple[str, list[dict]]:
    """(content, tool calls) of a reply; ([text], []) when it holds no well-formed call."""
    calls = []
    for i, m in enumerate(BLOCK.finditer(text)):
        try:
            call = json.loads(m.group(1))
        except json.JSONDecodeError:
            return text, []
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return text, []
        args = call.get("arguments", {})
        digest = hashlib.sha1(m.group(1).encode()).hexdigest()[:12]
        calls.append(
            {
                "id": f"call_{i}_{digest}",
                "type": "function",
                "function": {"name": call["name"], "arguments": args if isinstance(args, str) else json.dumps(args)},
            }
        )
    if not calls:
        return text, []
    return BLOCK.sub("", text).strip(), calls


def same_calls(a: list[dict] | None, b: list[dict] | None) -> bool:
    """Two lists of tool calls are the same calls: names and arguments (as JSON values: an agent
    may echo them re-serialised), in order."""

    def key(call: dict):
        f = call.get("function") or {}
        args = f.get("arguments")
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except json.JSONDecodeError:
            pass
        return f.get("name"), json.dumps(args, sort_keys=True)

    return [key(c) for c in a or []] == [key(c) for c in b or []]
