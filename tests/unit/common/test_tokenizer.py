import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.common.model_spec import DEFAULT_MODEL_DIR, ModelSpec
from services.common.tokenizer import CHAT_TEMPLATE, Tokenizer, render_chat

TOK = Tokenizer.from_dir()


def test_shipped_files_and_specials():
    spec = ModelSpec.from_dir()
    assert TOK.vocab_size == spec.vocab_size == 1024
    assert (TOK.bos_id, TOK.eos_id) == (1, 2) and spec.eos_token_id == 2
    assert TOK.special_ids == frozenset({0, 1, 2})
    cfg = json.loads((DEFAULT_MODEL_DIR / "tokenizer_config.json").read_text())
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert (cfg["bos_token"], cfg["eos_token"], cfg["unk_token"]) == ("<s>", "</s>", "<unk>")
    assert cfg["chat_template"] == CHAT_TEMPLATE
    smap = json.loads((DEFAULT_MODEL_DIR / "special_tokens_map.json").read_text())
    assert smap == {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    # every byte has its own token
    assert sorted(len(TOK.token_bytes(i)) for i in range(3, 259)) == [1] * 256
    assert {TOK.token_bytes(i) for i in range(3, 259)} == {bytes([b]) for b in range(256)}


def test_encode_adds_bos_once():
    ids = TOK.encode("Hello world")
    assert ids[0] == 1 and 1 not in ids[1:]
    assert TOK.encode("Hello world", add_bos=False) == ids[1:]
    assert TOK.encode("") == [1]
    assert TOK.decode(ids) == "Hello world"
    assert TOK.decode(ids, skip_special_tokens=False) == "<s>Hello world"


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_text_roundtrip(text):
    ids = TOK.encode(text, add_bos=False)
    assert all(0 <= i < 1024 for i in ids)
    assert TOK.decode(ids, skip_special_tokens=False) == text


@settings(max_examples=200, deadline=None)
@given(st.binary())
def test_bytes_roundtrip(data):
    ids = TOK.encode_bytes(data)
    assert ids[0] == 1
    assert TOK.decode_bytes(ids[1:]) == data


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(min_value=0, max_value=1023), max_size=40),
    st.lists(st.integers(min_value=1, max_value=5), min_size=1, max_size=40),
)
def test_incremental_detok_equals_decode(ids, cuts):
    """Random ids (broken UTF-8 included) split into random batches stream the same text."""
    det = TOK.detokenizer()
    out, pos, k = [], 0, 0
    while pos < len(ids):
        step = cuts[k % len(cuts)]
        piece = det.push(ids[pos : pos + step])
        piece.encode("utf-8")  # never a lone surrogate / half a character
        out.append(piece)
        pos, k = pos + step, k + 1
    out.append(det.flush())
    assert "".join(out) == TOK.decode(ids)
    assert det.text_len == len(TOK.decode(ids))


def test_incremental_detok_multibyte_held_back():
    # "é" = c3 a9, "😀" = f0 9f 98 80: feed byte tokens one at a time.
    byte_id = {TOK.token_bytes(i): i for i in range(3, 259)}
    ids = [byte_id[bytes([b])] for b in "é😀".encode()]
    det = TOK.detokenizer()
    assert det.push(ids[:1]) == ""
    assert det.push(ids[1:2]) == "é"
    assert [det.push([i]) for i in ids[2:5]] == ["", "", ""]
    assert det.push(ids[5:]) == "😀"
    assert det.flush() == ""
    # an unfinished character at the end becomes one replacement char
    det = TOK.detokenizer()
    assert det.push(ids[2:4]) == ""
    assert det.flush() == "\ufffd"
    # specials are skipped in streamed text
    det = TOK.detokenizer()
    assert det.push([1] + TOK.encode("hi", add_bos=False) + [2]) == "hi"


def test_chat_template_python_rendering():
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = TOK.apply_chat_template(msgs)
    assert text == "<s><|system|>\nBe brief.</s>\n<|user|>\nHi</s>\n<|assistant|>\n"
    assert render_chat(msgs, add_generation_prompt=False).endswith("Hi</s>\n")
    ids = TOK.encode_chat(msgs)
    assert ids[0] == 1 and ids.count(1) == 1 and ids.count(2) == 2
    assert TOK.decode(ids, skip_special_tokens=False) == text


def test_chat_template_matches_jinja():
    jinja2 = pytest.importorskip("jinja2.sandbox")
    env = jinja2.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    tmpl = env.from_string(CHAT_TEMPLATE)
    msgs = [{"role": "user", "content": "a\nb"}, {"role": "assistant", "content": "c"}]
    for gen in (True, False):
        want = tmpl.render(
            messages=msgs, add_generation_prompt=gen, bos_token="<s>", eos_token="</s>"
        )
        assert render_chat(msgs, gen) == want


def test_build_is_reproducible(tmp_path: Path):
    import importlib.util

    script = Path(__file__).resolve().parents[3] / "scripts" / "build_tokenizer.py"
    spec = importlib.util.spec_from_file_location("build_tokenizer", script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    try:
        paper = mod.find_paper(None)
    except SystemExit:
        pytest.skip("mooncake-paper.md not available")
    mod.write(mod.train(paper), tmp_path)
    for name in mod.FILES:
        assert (tmp_path / name).read_bytes() == (DEFAULT_MODEL_DIR / name).read_bytes(), name
