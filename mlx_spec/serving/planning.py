"""A request checked against the server's model and limits, and turned into a `Plan`."""

from __future__ import annotations

from dataclasses import dataclass

from mlx_spec.api import encode_prompt
from mlx_spec.core.compat import scored_vocab
from mlx_spec.decoding.runner import context_limit
from mlx_spec.serving.chat import chat_prompt, has_chat_template
from mlx_spec.serving.config import ServerConfig
from mlx_spec.serving.errors import APIError
from mlx_spec.serving.openai_schemas import SpeculativeOptions
from mlx_spec.serving.tools import PlainText, ToolCallStream, supports_tools, template_messages


@dataclass
class Plan:
    """What one request asks for, checked."""

    ids: list[int]
    max_tokens: int
    drafter_name: str | None  # None: plain decoding
    num_draft: int | str
    stops: list[str]
    tools: list[dict] | None = None  # the tools the template was given: parse calls
    forced_call: bool = False  # the prompt ends with the tool-call start marker

    def splitter(self, tokenizer) -> ToolCallStream | PlainText:
        """What turns the output text into content and tool calls."""
        if self.tools is None:
            return PlainText()
        return ToolCallStream(
            tokenizer.tool_call_start,
            tokenizer.tool_call_end or "",
            tokenizer.tool_parser,
            self.tools,
            in_call=self.forced_call,
        )


class Planner:
    """Checks what requests ask for (model, prompt, tools, limits, speculation) and plans them;
    shared by the OpenAI and the Anthropic endpoints."""

    def __init__(self, model, tokenizer, config: ServerConfig, drafters: dict):
        self.tokenizer, self.config, self.drafters = tokenizer, config, drafters
        self.vocab = scored_vocab(model, tokenizer)
        self.context = context_limit(model)
        self.templated = has_chat_template(tokenizer)

    def check_model(self, name: str) -> None:
        if name != self.config.model_id:
            raise APIError(
                404,
                f"the model {name!r} does not exist; this server serves {self.config.model_id!r}",
                param="model",
                code="model_not_found",
            )

    def chat_ids(
        self, messages: list[dict], tools: list[dict], tool_choice
    ) -> tuple[list[int], list[dict] | None, bool]:
        """Prompt ids for a chat, with the tools the template was given (None: no tool calls
        are parsed) and whether the prompt forces a call (tool_choice "required" or a named
        function: the prompt ends with the start marker)."""
        choice = tool_choice if tool_choice is not None else ("auto" if tools else "none")
        given = self._given_tools(tools, choice)
        try:
            text = chat_prompt(self.tokenizer, template_messages(messages), given)
        except Exception as exc:  # the template's own checks (jinja raises many types)
            raise APIError(
                400, f"the chat template cannot render these messages: {exc}",
                param="messages",
            ) from exc  # fmt: skip
        forced = bool(given) and choice != "auto"
        if forced:
            text += self.tokenizer.tool_call_start
        return encode_prompt(self.tokenizer, text), given, forced

    def _given_tools(self, tools: list[dict], choice) -> list[dict] | None:
        """The tools the template is given under `choice` (None: none, and no calls parsed)."""
        named = None if isinstance(choice, str) else choice.function.name
        if choice != "none" and not tools:
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        if named is not None:
            tools = [t for t in tools if t["function"]["name"] == named]
            if not tools:
                raise APIError(
                    400, f"tool_choice names {named!r}, which is not among the tools",
                    param="tool_choice",
                )  # fmt: skip
        given = tools if choice != "none" else None
        if given and not (self.templated and supports_tools(self.tokenizer)):
            raise APIError(
                400,
                "this model's chat template does not support tool calls",
                param="tools",
                code="tools_not_supported",
            )
        return given

    def check_plan(self, ids, requested, stops, speculative, chat: bool) -> Plan:
        """The plan for prompt `ids`, or APIError when it does not fit the limits."""
        if self.context is not None and len(ids) >= self.context:
            raise APIError(
                400,
                f"the prompt has {len(ids)} tokens; the model's context holds {self.context}",
                param="messages" if chat else "prompt",
                code="context_length_exceeded",
            )
        limit = self.config.max_tokens_limit
        if requested is not None and requested > limit:
            raise APIError(
                400, f"max_tokens is {requested}; this server allows at most {limit}",
                param="max_tokens", code="max_tokens_exceeded",
            )  # fmt: skip
        drafter_name, num_draft = self.speculation(speculative)
        return Plan(ids, requested or limit, drafter_name, num_draft, stops)

    def speculation(self, options: SpeculativeOptions | None):
        """(drafter name, num_draft) for the request's `speculative` field; (None, 0): none.
        A field that only asks for the trace leaves the server's default."""
        name = self.config.default_drafter
        enabled = name is not None
        num_draft = self.config.num_draft
        if options is not None and options.model_fields_set != {"trace"}:
            enabled = options.enabled
            name = options.drafter or name or "ngram"
            if options.num_draft is not None:
                num_draft = options.num_draft
        if name is not None and name not in self.drafters:
            raise APIError(
                400,
                f"unknown drafter {name!r}; this server offers {', '.join(sorted(self.drafters))}",
                param="speculative.drafter",
                code="unknown_drafter",
            )
        if not enabled or num_draft == 0:
            return None, 0
        return name, num_draft
