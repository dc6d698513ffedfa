"""Tool calls in generated text: the model's chat template announces them between markers (e.g.
`<tool_call>...</tool_call>`), and mlx-lm's tokenizer knows the markers and the parser of each
model family (`mlx_lm.tool_parsers`, chosen from the chat template when the tokenizer is
loaded). `ToolCallStream` splits a stream of text into content and parsed calls as it arrives,
holding back only what may be the start of a marker.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from mlx_spec.core.stopping import partial_suffix


@dataclass
class ToolCall:
    """One parsed call, as OpenAI returns it: `arguments` is a JSON string."""

    id: str
    name: str
    arguments: str

    def openai(self, index: int | None = None) -> dict:
        out = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return out if index is None else {"index": index, **out}

    def input(self) -> dict:
        """The arguments as an object (Anthropic's `tool_use.input`)."""
        try:
            value = json.loads(self.arguments)
        except json.JSONDecodeError:
            return {"arguments": self.arguments}
        return value if isinstance(value, dict) else {"arguments": value}


def supports_tools(tokenizer) -> bool:
    """Whether mlx-lm found tool-call markers and a parser for this tokenizer's template."""
    return bool(
        getattr(tokenizer, "has_tool_calling", False)
        and getattr(tokenizer, "tool_parser", None) is not None
    )


def new_call_id(prefix: str = "call_") -> str:
    return prefix + uuid.uuid4().hex[:24]


def _calls(parsed, prefix: str) -> list[ToolCall]:
    items = parsed if isinstance(parsed, list) else [parsed]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise ValueError(f"a tool call without a name: {item!r}")
        arguments = item.get("arguments", {})
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        calls.append(ToolCall(item.get("id") or new_call_id(prefix), item["name"], arguments))
    return calls


class ToolCallStream:
    """Content and tool calls from generated text, fed piece by piece.

    Args:
        start, end: the markers around one call (`end` may be empty: the call runs to the end
            of the output).
        parse: mlx-lm's `parse_tool_call(text, tools)` for the model family.
        tools: the request's tool definitions (some parsers read argument types from them).
        in_call: the output starts inside a call (the prompt ended with `start`).
        id_prefix: prefix of the ids given to calls that the model did not name.
    """

    def __init__(
        self,
        start: str,
        end: str,
        parse: Callable,
        tools: list | None = None,
        *,
        in_call: bool = False,
        id_prefix: str = "call_",
    ):
        if not start:
            raise ValueError("a tool-call start marker is needed")
        self.start, self.end, self.parse, self.tools = start, end, parse, tools
        self.id_prefix = id_prefix
        self._in_call = in_call
        self._buffer = ""
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> list[str | ToolCall]:
        """Events for `text`: content strings and parsed calls, in order."""
        self._buffer += text
        events: list[str | ToolCall] = []
        while True:
            if self._in_call:
                if not self.end:
                    return events
                cut = self._buffer.find(self.end)
                if cut < 0:
                    return events
                events += self._close(self._buffer[:cut], closed=True)
                self._buffer = self._buffer[cut + len(self.end) :]
                self._in_call = False
            else:
                cut = self._buffer.find(self.start)
                if cut < 0:
                    hold = partial_suffix(self._buffer, [self.start])
                    ready = self._buffer[: len(self._buffer) - hold]
                    self._buffer = self._buffer[len(ready) :]
                    return events + ([ready] if ready else [])
                if cut:
                    events.append(self._buffer[:cut])
                self._buffer = self._buffer[cut + len(self.start) :]
                self._in_call = True

    def finish(self) -> list[str | ToolCall]:
        """Events for what is still held when the output ends: an unfinished call is parsed if
        it can be, else returned as text so nothing is lost."""
        rest, self._buffer = self._buffer, ""
        if not self._in_call:
            return [rest] if rest else []
        self._in_call = False
        return self._close(rest, closed=False)

    def _close(self, body: str, closed: bool) -> list[str | ToolCall]:
        try:
            calls = _calls(self.parse(body, self.tools), self.id_prefix)
        except Exception:  # the parsers raise many types on text that is not a call
            return [self.start + body + (self.end if closed else "")]
        self.calls += calls
        return list(calls)


class PlainText:
    """The `ToolCallStream` interface for output that is all content (no tools given)."""

    calls: list[ToolCall] = []

    def feed(self, text: str) -> list[str | ToolCall]:
        return [text] if text else []

    def finish(self) -> list[str | ToolCall]:
        return []


def template_messages(messages: list[dict]) -> list[dict]:
    """OpenAI-shaped messages as chat templates expect them: tool-call arguments as objects,
    not JSON strings."""
    out = []
    for message in messages:
        message = dict(message)
        if message.get("tool_calls"):
            calls = []
            for call in message["tool_calls"]:
                call = dict(call)
                function = dict(call.get("function") or {})
                arguments = function.get("arguments")
                if isinstance(arguments, str):
                    try:
                        function["arguments"] = json.loads(arguments) if arguments else {}
                    except json.JSONDecodeError:
                        pass  # not JSON: the template gets the text
                call["function"] = function
                calls.append(call)
            message["tool_calls"] = calls
        out.append(message)
    return out
