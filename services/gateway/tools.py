"""Tool calling as vLLM's OpenAI server does it (``chat_completion/serving.py`` and
``vllm/tool_parsers``), on the gateway.

- ``tools`` go to the chat template (:meth:`Tokenizer.encode_chat`);
- ``tool_choice`` ``"required"`` or a named function: the answer is constrained by a
  JSON schema derived from the tools exactly as vLLM derives it (``tool_parsers/utils.py``:
  the function's parameters, or an array of ``{name, parameters}``), through the
  structured-output path (:class:`bus_schemas.requests.StructuredOutput`), and the
  answer's JSON becomes ``tool_calls``;
- ``"auto"`` (the default when tools are given): the answer's text goes through one of
  vLLM's tool parsers, picked with the gateway's ``--tool-call-parser`` (imported only
  then: vLLM is a heavy import for a gateway), streamed and not;
- ``"none"``: tools are rendered, the answer is text.

Pure except for the parser, which is vLLM's own object.
"""

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from services.gateway.protocol import ApiError


@dataclass
class ToolRequest:
    """The tools of one chat request, checked."""

    tools: list[dict]  # as sent ({"type": "function", "function": {...}})
    choice: str  # "none" | "auto" | "required" | "function"
    name: str | None = None  # tool_choice's function
    parallel: bool | None = None
    output: "ToolOutput | None" = None  # the server's, for the answer

    def schema(self) -> dict | None:
        """The JSON schema that constrains the answer (named / required), else None."""
        if self.choice == "function":
            fn = next(t["function"] for t in self.tools if t["function"]["name"] == self.name)
            return _params(fn.get("parameters"))
        if self.choice == "required":
            return _required_schema(self.tools, self.parallel)
        return None


def parse_tools(
    tools: Any, tool_choice: Any, parallel: bool | None, parser: str | None
) -> ToolRequest | None:
    """``tools`` and ``tool_choice`` of a chat body, as vLLM checks them (400 otherwise)."""
    if tool_choice is not None and not tools:
        if tool_choice == "none":
            return None
        raise ApiError(400, "tool_choice is only allowed when tools are given", param="tool_choice")
    if not tools:
        return None
    if not isinstance(tools, list) or not all(_is_function_tool(t) for t in tools):
        raise ApiError(
            400,
            'each tool must be {"type": "function", "function": {"name": str, '
            '"parameters": object?}}',
            param="tools",
        )
    names = [t["function"]["name"] for t in tools]
    choice, name = "auto" if tool_choice is None else tool_choice, None
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise ApiError(
                400,
                'a named tool_choice is {"type": "function", "function": {"name": str}}',
                param="tool_choice",
            )
        if name not in names:
            raise ApiError(
                400, f"tool_choice names {name!r}, which is not in tools", param="tool_choice"
            )
        choice = "function"
    elif choice not in ("none", "auto", "required"):
        raise ApiError(
            400,
            "tool_choice must be none, auto, required or a named function",
            param="tool_choice",
        )
    if choice == "auto" and parser is None:
        raise ApiError(
            400,
            '"auto" tool choice needs the gateway started with --tool-call-parser '
            "(vLLM: --enable-auto-tool-choice --tool-call-parser); send tool_choice "
            '"none", "required" or a named function',
            param="tool_choice",
        )
    return ToolRequest(list(tools), choice, name, parallel)


def _is_function_tool(t: Any) -> bool:
    if not isinstance(t, dict) or t.get("type", "function") != "function":
        return False
    fn = t.get("function")
    return (
        isinstance(fn, dict)
        and isinstance(fn.get("name"), str)
        and bool(fn["name"])
        and isinstance(fn.get("parameters", {}) or {}, dict)
    )


def _params(params: dict | None) -> dict:
    return params if params else {"type": "object", "properties": {}}


def _required_schema(tools: list[dict], parallel: bool | None) -> dict:
    """vLLM's ``_get_json_schema_from_tools``: an array of calls, each one tool's name and
    parameters; ``parallel_tool_calls: false`` allows one call."""
    defs: dict[str, Any] = {}
    variants = []
    for t in tools:
        fn = t["function"]
        params = dict(fn.get("parameters") or {})
        for k, v in (params.pop("$defs", None) or {}).items():
            if k in defs and defs[k] != v:
                raise ApiError(400, f"tool definition {k!r} has several schemas", param="tools")
            defs[k] = v
        variants.append(
            {
                "properties": {
                    "name": {"type": "string", "enum": [fn["name"]]},
                    "parameters": _params(params),
                },
                "required": ["name", "parameters"],
            }
        )
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {"type": "object", "anyOf": variants},
    }
    if parallel is False:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def _call(name: str, arguments: str) -> dict:
    return {"id": call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


class ToolOutput:
    """Turns one answer's text into ``tool_calls``, whole (:meth:`message`) or as stream
    deltas (:meth:`delta`, then :meth:`end`)."""

    def __init__(self, req: ToolRequest, parser: Any = None, vllm_request: Any = None) -> None:
        self.req = req
        self.parser = parser  # a vLLM ToolParser instance ("auto")
        self.vllm_request = vllm_request
        self._text = ""
        self._ids: list[int] = []
        self._sent_named = False
        self.called = False  # a tool call was made (finish_reason "tool_calls")

    # -- whole --------------------------------------------------------------------
    def message(self, text: str, finish: str) -> tuple[dict, str]:
        """(the assistant message, the finish reason) for the whole answer."""
        r = self.req
        if r.choice == "function":
            assert r.name is not None
            return _msg("", [_call(r.name, text)]), finish
        if r.choice == "required":
            calls = _calls_from_json(text)
            if calls is None:
                return _msg(text), finish
            self.called = True
            return _msg("", calls), "tool_calls" if finish == "stop" else finish
        if r.choice == "auto" and self.parser is not None:
            info = self.parser.extract_tool_calls(text, self.vllm_request)
            if info.tools_called and info.tool_calls:
                self.called = True
                calls = [
                    {
                        "id": tc.id or call_id(),
                        "type": "function",
                        "function": {
                            "name": tc.function.name,
                            "arguments": tc.function.arguments,
                        },
                    }
                    for tc in info.tool_calls
                ]
                return _msg(info.content, calls), "tool_calls"
        return _msg(text), finish

    # -- streamed -----------------------------------------------------------------
    def delta(self, text: str, ids: Sequence[int]) -> dict | None:
        """The chat ``delta`` for ``text`` (the answer's next piece), None when nothing is
        to be sent yet."""
        r = self.req
        if r.choice == "function":
            assert r.name is not None
            if not self._sent_named:
                self._sent_named = True
                call = {**_call(r.name, text), "index": 0}
                return {"tool_calls": [call]}
            return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]} if text else None
        if r.choice == "required":
            self._text += text  # whole calls at the end: the JSON must be complete
            return None
        if r.choice == "auto" and self.parser is not None:
            prev_text, prev_ids = self._text, list(self._ids)
            self._text += text
            self._ids += ids
            d = self.parser.extract_tool_calls_streaming(
                prev_text, self._text, text, prev_ids, self._ids, list(ids), self.vllm_request
            )
            if d is None:
                return None
            out = d.model_dump(exclude_unset=True, exclude_none=True)
            if out.get("tool_calls"):
                self.called = True
            return out or None
        return {"content": text} if text else None

    def end(self, finish: str) -> tuple[dict | None, str]:
        """(a last delta, the finish reason) when the stream ends."""
        if self.req.choice == "required":
            calls = _calls_from_json(self._text)
            if calls is None:
                return ({"content": self._text} if self._text else None), finish
            self.called = True
            out = [{**c, "index": i} for i, c in enumerate(calls)]
            return {"tool_calls": out}, "tool_calls" if finish == "stop" else finish
        if self.called and finish == "stop":
            return None, "tool_calls"
        return None, finish


def _msg(content: str | None, calls: list[dict] | None = None) -> dict:
    m: dict[str, Any] = {"role": "assistant", "content": content}
    if calls is not None:
        m["tool_calls"] = calls
    return m


def _calls_from_json(text: str) -> list[dict] | None:
    try:
        items = json.loads(text)
    except ValueError:
        return None
    if not isinstance(items, list) or not all(
        isinstance(c, dict) and isinstance(c.get("name"), str) for c in items
    ):
        return None
    return [
        _call(c["name"], json.dumps(c.get("parameters", {}), ensure_ascii=False)) for c in items
    ]


def load_parser(name: str, model_dir: str) -> Any:
    """vLLM's tool parser class ``name`` and the model's tokenizer for it (vLLM's own
    loader); the gateway's ``--tool-call-parser``."""
    from vllm.tokenizers import get_tokenizer
    from vllm.tool_parsers import ToolParserManager

    try:
        cls = ToolParserManager.get_tool_parser(name)
    except KeyError:
        raise ValueError(f"unknown --tool-call-parser {name!r}") from None
    return cls, get_tokenizer(model_dir)


def vllm_request(raw: dict) -> Any:
    """The body as vLLM's ChatCompletionRequest (what its parsers read)."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    return ChatCompletionRequest.model_validate(raw)
