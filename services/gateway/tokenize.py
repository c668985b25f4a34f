"""``POST /tokenize`` and ``POST /detokenize`` as vLLM's server has them
(``vllm/entrypoints/serve/tokenize``): a completion prompt (``add_special_tokens``, default
true) or chat messages (the chat template, ``add_generation_prompt`` default true) to
``{count, max_model_len, tokens, token_strs}``; token ids to ``{prompt}``. Pure: the
server passes its tokenizer in.
"""

from typing import Any

import msgspec

from services.common.tokenizer import Tokenizer
from services.gateway.protocol import ApiError, ChatMessage, flatten_messages


class TokenizeBody(msgspec.Struct, kw_only=True):
    """The body of ``POST /tokenize``: a completion prompt or chat messages."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool | None = False


class DetokenizeBody(msgspec.Struct, kw_only=True):
    """The body of ``POST /detokenize``: token ids."""

    model: str | None = None
    tokens: list[int]


def _decode(data: bytes, tp: type) -> Any:
    try:
        return msgspec.json.decode(data, type=tp)
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise ApiError(400, f"invalid request body: {e}") from None
    except RecursionError:
        raise ApiError(400, "request body nests too deeply") from None


def tokenize(
    data: bytes, tok: Tokenizer, max_model_len: int, max_messages: int, content_specials: bool
) -> tuple[str | None, dict]:
    """(the model named, the response body)."""
    body: TokenizeBody = _decode(data, TokenizeBody)
    if (body.prompt is None) == (body.messages is None):
        raise ApiError(400, "send exactly one of `prompt` and `messages`", param="prompt")
    if body.messages is not None:
        msgs = flatten_messages(body.messages, max_messages)
        if body.add_special_tokens:  # vLLM: BOS on top of the template's (default off)
            ids = tok.encode(tok.apply_chat_template(msgs, body.add_generation_prompt), True)
        else:
            try:
                ids = tok.encode_chat(
                    msgs, body.add_generation_prompt, content_specials=content_specials
                )
            except Exception as e:  # noqa: BLE001 - the template refused the messages
                raise ApiError(
                    400, f"the chat template cannot render these messages: {e}", param="messages"
                ) from None
    else:
        ids = tok.encode(body.prompt or "", add_bos=body.add_special_tokens is not False)
    out: dict[str, Any] = {
        "count": len(ids),
        "max_model_len": max_model_len,
        "tokens": ids,
        "token_strs": [tok.id_to_token(i) for i in ids] if body.return_token_strs else None,
    }
    return body.model, out


def detokenize(data: bytes, tok: Tokenizer) -> tuple[str | None, dict]:
    body: DetokenizeBody = _decode(data, DetokenizeBody)
    bad = next((t for t in body.tokens if not 0 <= t < tok.vocab_size), None)
    if bad is not None:
        raise ApiError(400, f"token id {bad} is out of range [0, {tok.vocab_size})", param="tokens")
    return body.model, {"prompt": tok.decode(body.tokens, skip_special_tokens=False)}
