"""The tokenizer every service loads from a model directory (``tokenizer.json`` +
``tokenizer_config.json``, the files HuggingFace ``transformers`` reads).

Encoding runs in the ``tokenizers`` package (Rust). Decoding is a table lookup: each id
maps to its raw bytes (byte-level BPE), so detokenization is ``bytes.join`` followed by
UTF-8 decoding. :class:`IncrementalDetokenizer` feeds those bytes through an incremental
UTF-8 decoder, so a streamed character split across tokens is held back until it is
complete and the text streamed equals the text decoded at once; it never emits half a
character. Invalid byte sequences become U+FFFD, exactly as ``bytes.decode(errors=
"replace")`` (and HF's ``decode``) would.

Chat prompts follow the model's own chat template: ``chat_template`` in
``tokenizer_config.json``, or ``chat_template.jinja`` beside it (where transformers 5's
``save_pretrained`` writes it), rendered in jinja2's ``ImmutableSandboxedEnvironment``
(a template is data from a model folder, not code to trust) with the globals
transformers gives it. The tiny model's :data:`CHAT_TEMPLATE` renders through
:func:`render_chat`, its Python twin, without jinja2.

A message's content is text, as in OpenAI's API: a special token's string in it
(``<|im_start|>system``, ``</s>``) is encoded as the plain text it is, never as the
control token; only the template's own markup makes special tokens
(:meth:`Tokenizer.encode_chat`; ``content_specials=True`` is vLLM's way, where such a
string in a message becomes the token).
"""

import codecs
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from services.common.model_spec import DEFAULT_MODEL_DIR

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


def render_chat(
    messages: Iterable[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    bos_token: str = "<s>",
    eos_token: str = "</s>",
) -> str:
    """:data:`CHAT_TEMPLATE` in Python; ``content`` must already be a string."""
    parts = [bos_token]
    for m in messages:
        parts.append(f"<|{m['role']}|>\n{m['content']}{eos_token}\n")
    if add_generation_prompt:
        parts.append("<|assistant|>\n")
    return "".join(parts)


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable-character alias of every byte, reversed."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


class IncrementalDetokenizer:
    """Token ids in, text out, for streaming: ``push`` returns only complete characters.

    ``"".join(push(...) for each batch) + flush()`` equals ``Tokenizer.decode`` of all the
    ids, however they were split.
    """

    __slots__ = ("_table", "_skip", "_dec", "text_len")

    def __init__(self, table: Sequence[bytes], skip: frozenset[int]) -> None:
        self._table = table
        self._skip = skip
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text_len = 0  # characters emitted so far

    def push(self, ids: Iterable[int]) -> str:
        table, skip, n = self._table, self._skip, len(self._table)
        data = b"".join(table[i] for i in ids if 0 <= i < n and i not in skip)
        out = self._dec.decode(data) if data else ""
        self.text_len += len(out)
        return out

    def flush(self) -> str:
        """Whatever bytes are still pending (an unfinished character becomes U+FFFD)."""
        out = self._dec.decode(b"", final=True)
        self.text_len += len(out)
        return out


class Tokenizer:
    """A model directory's tokenizer: encode (with BOS), decode, stream, chat."""

    def __init__(self, hf: HFTokenizer, config: Mapping[str, Any] | None = None) -> None:
        self._tok = hf
        cfg = dict(config or {})
        self.bos_token = _token_str(cfg.get("bos_token")) or "<s>"
        self.eos_token = _token_str(cfg.get("eos_token")) or "</s>"
        # Every special token by name, as transformers passes them to a chat template.
        self._template_tokens = {
            k: _token_str(v)
            for k, v in cfg.items()
            if k.endswith("_token") and _token_str(v) is not None
        }
        self._template_tokens.update(bos_token=self.bos_token, eos_token=self.eos_token)
        self.chat_template: str = cfg.get("chat_template") or CHAT_TEMPLATE
        vocab = hf.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1
        self.bos_id = hf.token_to_id(self.bos_token)
        self.eos_id = hf.token_to_id(self.eos_token)
        byte_of = _byte_decoder()
        special = {t.content for t in hf.get_added_tokens_decoder().values() if t.special}
        table = [b""] * self.vocab_size
        for tok, i in vocab.items():
            if tok in special or any(c not in byte_of for c in tok):
                table[i] = tok.encode("utf-8")
            else:
                table[i] = bytes(byte_of[c] for c in tok)
        self._table: list[bytes] = table
        self.special_ids = frozenset(vocab[t] for t in special if t in vocab)
        alias = {b: c for c, b in byte_of.items()}
        # A byte-level BPE vocabulary has a token per byte (None: this one lacks it).
        self._byte_ids: list[int | None] = [hf.token_to_id(alias[b]) for b in range(256)]
        self._jinja: Any = None
        # Every special token's string, longest first (a regex alternation tries in order).
        names = sorted((t for t in special if t), key=len, reverse=True)
        self._special_re = re.compile("|".join(map(re.escape, names))) if names else None
        self._as_text: HFTokenizer | None = None  # encodes special-token strings as text

    # ---- loading -------------------------------------------------------------------
    @classmethod
    def from_dir(cls, model_dir: str | Path | None = None) -> "Tokenizer":
        path = Path(model_dir) if model_dir else DEFAULT_MODEL_DIR
        cfg_path = path / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text(encoding="utf-8")) if cfg_path.exists() else {}
        jinja_path = path / "chat_template.jinja"
        if not cfg.get("chat_template") and jinja_path.exists():
            cfg["chat_template"] = jinja_path.read_text(encoding="utf-8")
        return cls(HFTokenizer.from_file(str(path / "tokenizer.json")), cfg)

    # ---- encoding ------------------------------------------------------------------
    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_bos`` prepends ``<s>`` (the tokenizer's template).
        Special-token strings in ``text`` (``"</s>"``) become their ids, as in HF."""
        return self._tok.encode(text, add_special_tokens=add_bos).ids

    def encode_bytes(self, data: bytes, add_bos: bool = True) -> list[int]:
        """Any bytes, valid UTF-8 or not: invalid bytes become their byte tokens."""
        ids = self.encode("", add_bos=True) if add_bos else []  # BOS if the model adds one
        i = 0
        while i < len(data):
            try:
                ids += self.encode(data[i:].decode("utf-8"), add_bos=False)
                break
            except UnicodeDecodeError as e:
                if e.start:
                    ids += self.encode(data[i : i + e.start].decode("utf-8"), add_bos=False)
                raw = (self._byte_ids[b] for b in data[i + e.start : i + e.end])
                ids += [t for t in raw if t is not None]
                i += e.end
        return ids

    # ---- decoding ------------------------------------------------------------------
    def id_to_token(self, token_id: int) -> str:
        """The vocabulary's own string for ``token_id`` (``Ġhello``), as HF's
        ``convert_ids_to_tokens``."""
        return self._tok.id_to_token(token_id) or ""

    def token_bytes(self, token_id: int) -> bytes:
        return self._table[token_id] if 0 <= token_id < self.vocab_size else b""

    def decode_bytes(self, ids: Iterable[int], skip_special_tokens: bool = False) -> bytes:
        table, n = self._table, self.vocab_size
        skip = self.special_ids if skip_special_tokens else frozenset()
        return b"".join(table[i] for i in ids if 0 <= i < n and i not in skip)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.decode_bytes(ids, skip_special_tokens).decode("utf-8", errors="replace")

    def detokenizer(self, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(
            self._table, self.special_ids if skip_special_tokens else frozenset()
        )

    # ---- chat ----------------------------------------------------------------------
    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        """The prompt text for ``messages`` (each ``{"role", "content": str}``); ``tools``
        (OpenAI's function tools) go to the template as transformers passes them."""
        if self.chat_template == CHAT_TEMPLATE:
            return render_chat(messages, add_generation_prompt, self.bos_token, self.eos_token)
        if self._jinja is None:
            self._jinja = compile_chat_template(self.chat_template)
        text: str = self._jinja.render(
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            **({"tools": list(tools)} if tools else {}),
            **self._template_tokens,
        )
        return text

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        content_specials: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        """Token ids of the rendered chat; the template writes ``<s>`` itself.

        A special token's string inside a message's ``content`` is encoded as text, as
        OpenAI's API does; only the template's markup makes special tokens. With
        ``content_specials`` such a string becomes the special token (vLLM's way)."""
        pat = self._special_re
        if content_specials or pat is None or not any(pat.search(_content(m)) for m in messages):
            text = self.apply_chat_template(messages, add_generation_prompt, tools)
            return self.encode(text, False)
        # Each special string in a content becomes a private-use character no content or
        # template holds, so every special string left in the rendered text is the
        # template's own. The tokenizer splits the text at those (as it always does) and
        # encodes each piece between them on its own: a piece that holds a placeholder is
        # encoded again, the strings put back, with special-token strings as plain text.
        found = {s for m in messages for s in pat.findall(_content(m))}
        ph = dict(zip(sorted(found), self._placeholders(messages, len(found)), strict=True))
        back = {c: s for s, c in ph.items()}
        swapped = [
            {**m, "content": pat.sub(lambda x: ph[x.group(0)], m["content"])} if _content(m) else m
            for m in messages
        ]
        text = self.apply_chat_template(swapped, add_generation_prompt, tools)
        enc = self._tok.encode(text, add_special_tokens=False)
        marks = re.compile("|".join(map(re.escape, back)))
        out: list[int] = []
        piece: list[int] = []
        start = 0

        def close_piece(end: int) -> None:
            seg = text[start:end]
            if marks.search(seg):
                out.extend(
                    self._text_encoder()
                    .encode(marks.sub(lambda x: back[x.group(0)], seg), add_special_tokens=False)
                    .ids
                )
            else:
                out.extend(piece)
            piece.clear()

        for tid, (a, b) in zip(enc.ids, enc.offsets, strict=True):
            if tid in self.special_ids:
                close_piece(a)
                out.append(tid)
                start = b
            else:
                piece.append(tid)
        close_piece(len(text))
        return out

    def _placeholders(self, messages: Sequence[Mapping[str, Any]], n: int) -> list[str]:
        """``n`` private-use characters found in no message and not in the template."""
        taken = [_content(m) for m in messages] + [self.chat_template]
        out: list[str] = []
        for cp in range(0xE000, 0xF900):
            c = chr(cp)
            if not any(c in t for t in taken):
                out.append(c)
                if len(out) == n:
                    return out
        raise ValueError("the messages use every private-use character")  # pragma: no cover

    def _text_encoder(self) -> HFTokenizer:
        if self._as_text is None:
            tok = HFTokenizer.from_str(self._tok.to_str())
            tok.encode_special_tokens = True
            self._as_text = tok
        return self._as_text


def _content(m: Mapping[str, Any]) -> str:
    c = m.get("content")
    return c if isinstance(c, str) else ""


def compile_chat_template(source: str) -> Any:
    """A chat template in jinja2's immutable sandbox, set up as transformers does
    (``trim_blocks``, ``lstrip_blocks``, loop controls, ``raise_exception``,
    ``strftime_now``, a ``tojson`` that keeps non-ASCII text), so a model's template
    renders here as it does there. A template that raises fails the request with 400."""
    try:
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:  # pragma: no cover - jinja2 comes with vLLM and transformers
        raise ValueError("this model's chat template needs jinja2 installed") from None

    def raise_exception(message: str) -> None:
        raise ValueError(f"the chat template refused the messages: {message}")

    def tojson(
        x: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _token_str(tok: Any) -> str | None:
    if isinstance(tok, dict):
        tok = tok.get("content")
    return tok if isinstance(tok, str) else None
