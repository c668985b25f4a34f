"""Build the shipped byte-level BPE tokenizer of models/tiny-llama, deterministically.

    .venv/bin/python scripts/build_tokenizer.py [--paper PATH] [--out models/tiny-llama] [--check]

Trains a GPT-2 style byte-level BPE (the `tokenizers` package) on the Mooncake paper
(CC BY 4.0, ``shared/reference/mooncake-paper.md``) plus a small corpus generated here
from fixed lists, and writes the files HuggingFace ``transformers`` (and so vLLM)
load from a model directory:

    tokenizer.json           the model: 3 specials + 256 byte tokens + merges = 1024 ids
    tokenizer_config.json    PreTrainedTokenizerFast, <s>/</s>/<unk>, the chat template
    special_tokens_map.json

Ids: <unk>=0, <s>=1, </s>=2 (matches config.json's bos/eos), then the 256 byte tokens,
then merges. Every byte has a token, so any byte sequence round-trips. ``--check``
rebuilds into a temporary directory and exits 1 if the files differ from ``--out``.
"""

import argparse
import filecmp
import json
import sys
import tempfile
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

# One template, in services.common.tokenizer: render_chat there is its Python twin.
from services.common.tokenizer import CHAT_TEMPLATE

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "models" / "tiny-llama"
PAPER_CANDIDATES = [
    REPO.parent / "shared" / "reference" / "mooncake-paper.md",
    Path("/work/shared/reference/mooncake-paper.md"),
]

VOCAB_SIZE = 1024
UNK, BOS, EOS = "<unk>", "<s>", "</s>"
SPECIALS = [UNK, BOS, EOS]
MODEL_MAX_LENGTH = 8192

_WORDS = (
    "the of and to in is that for it as with was on be by this are from at or an have not "
    "which but all were can has more one their there been if would will when what so no out "
    "up into do about than them some could other time these two may then first any like now "
    "only its over also new after use how our work well way even because good very through "
    "request requests token tokens prompt model cache prefix block blocks decode prefill "
    "latency throughput server client user assistant system hello world please thank you "
    "question answer write code python function return value error number list string"
).split()


def generated_corpus() -> str:
    """A fixed, seed-free corpus: chat markers, numbers, words in simple patterns, code."""
    lines: list[str] = []
    for role in ("system", "user", "assistant", "developer", "tool"):
        lines += [f"<|{role}|>\n"] * 40
    lines += [f"{i} " for i in range(0, 1000)]
    lines += [f"{i}.{i % 10}% " for i in range(0, 200)]
    n = len(_WORDS)
    for i in range(n):
        a, b, c = _WORDS[i], _WORDS[(i * 7 + 3) % n], _WORDS[(i * 13 + 5) % n]
        lines.append(f"{a.capitalize()} {b} {c}. {c} {a}, {b}!\n")
    lines += [
        "def main():\n    return 0\n",
        "for i in range(10):\n    print(i)\n",
        'if __name__ == "__main__":\n    main()\n',
        '{"role": "user", "content": "Hello!"}\n',
    ] * 20
    return "".join(lines)


def find_paper(path: str | None) -> Path:
    for p in [Path(path)] if path else PAPER_CANDIDATES:
        if p.is_file():
            return p
    raise SystemExit(f"mooncake-paper.md not found (tried {PAPER_CANDIDATES}); pass --paper")


def train(paper: Path) -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        show_progress=False,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    texts = [paper.read_text(encoding="utf-8"), generated_corpus()]
    # Feed paragraphs in a fixed order; the trainer's counts do not depend on batching.
    chunks = [para for t in texts for para in t.split("\n\n") if para]
    tok.train_from_iterator(chunks, trainer=trainer, length=len(chunks))
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A",
        pair=f"{BOS} $A {BOS} $B",
        special_tokens=[(BOS, tok.token_to_id(BOS))],
    )
    got = {s: tok.token_to_id(s) for s in SPECIALS}
    if got != {UNK: 0, BOS: 1, EOS: 2} or tok.get_vocab_size() != VOCAB_SIZE:
        raise SystemExit(f"unexpected vocab: specials {got}, size {tok.get_vocab_size()}")
    return tok


def _dump(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False, sort_keys=False) + "\n")


def write(tok: Tokenizer, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    # Tokenizer.to_str(pretty) is stable for a given vocab/merges: ordered by id.
    (out / "tokenizer.json").write_text(tok.to_str(pretty=True) + "\n", encoding="utf-8")
    added = {
        str(tok.token_to_id(s)): {
            "content": s,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for s in SPECIALS
    }
    _dump(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "added_tokens_decoder": added,
            "bos_token": BOS,
            "eos_token": EOS,
            "unk_token": UNK,
            "clean_up_tokenization_spaces": False,
            "model_max_length": MODEL_MAX_LENGTH,
            "chat_template": CHAT_TEMPLATE,
        },
    )
    _dump(out / "special_tokens_map.json", {"bos_token": BOS, "eos_token": EOS, "unk_token": UNK})


FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--paper", help="path of mooncake-paper.md")
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    ap.add_argument("--check", action="store_true", help="verify --out is what a rebuild writes")
    args = ap.parse_args(argv)
    tok = train(find_paper(args.paper))
    out = Path(args.out)
    if not args.check:
        write(tok, out)
        print(f"wrote {', '.join(FILES)} to {out} (vocab {tok.get_vocab_size()})")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        write(tok, Path(tmp))
        bad = [f for f in FILES if not filecmp.cmp(Path(tmp) / f, out / f, shallow=False)]
    if bad:
        print(f"differs from a rebuild: {bad}", file=sys.stderr)
        return 1
    print("tokenizer files match a rebuild")
    return 0


if __name__ == "__main__":
    sys.exit(main())
