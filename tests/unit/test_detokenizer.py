"""Incremental detokenization: streamed deltas must add up to the full decode."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path

import pytest
import transformers
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from lmd.tokenizer.text import detokenizer
from lmd.tokenizer.text.detokenizer import NUM_CONTEXT_TOKENS, CachedDecoder, Detokenizer
from tests.qwen3 import QWEN3_DIR

TEXTS = [
    "The capital of France is Paris.",
    "  two leading spaces, trailing ones  ",
    "café, naïve, résumé, Ångström, Crème brûlée",
    "日本語のテキストと中文字符\uff0c还有한국어。",
    "emoji 😀🎉 family 👨‍👩‍👧 flag 🇫🇷 and é́ combining",
    "code:\n\tdef f(x):\n\t\treturn x ** 2  # ok\n",
]


@pytest.fixture(scope="session")
def smollm2(smollm2_dir: Path) -> Tokenizer:
    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
    backend: Tokenizer = tokenizer.backend_tokenizer
    return backend


@pytest.fixture(scope="session")
def qwen3() -> Tokenizer:
    if not (QWEN3_DIR / "tokenizer.json").is_file():
        pytest.skip(f"no tokenizer in {QWEN3_DIR}")
    backend: Tokenizer = transformers.AutoTokenizer.from_pretrained(QWEN3_DIR).backend_tokenizer
    return backend


@pytest.fixture(scope="session")
def byte_level() -> Tokenizer:
    return build_byte_level()


@pytest.fixture(scope="session")
def sentencepiece() -> Tokenizer:
    return build_sentencepiece()


def build_byte_level() -> Tokenizer:
    """A GPT-2 style byte-level BPE, trained tiny so that most characters span tokens."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(TEXTS * 5, trainer)
    return tokenizer


def build_sentencepiece() -> Tokenizer:
    """A Llama 2 style tokenizer: "▁" for spaces, byte fallback, one leading space
    stripped on decode."""
    space = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.normalizer = space
    trained.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
    trainer = trainers.BpeTrainer(
        vocab_size=150, special_tokens=["<unk>", "<s>", "</s>"], limit_alphabet=40
    )
    trained.train_from_iterator(TEXTS[:3] * 5, trainer)
    model = json.loads(trained.to_str())["model"]
    vocab: dict[str, int] = model["vocab"]
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    merges = [tuple(m) for m in model["merges"]]
    tokenizer = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True)
    )
    tokenizer.normalizer = space
    tokenizer.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tokenizer.add_special_tokens(["<unk>", "<s>", "</s>"])
    return tokenizer


def deltas(detok: Detokenizer, ids: list[int], chunks: list[int] | None = None) -> list[str]:
    """Feed ids in chunks of the given sizes (default one at a time), then finish."""
    out = []
    i = 0
    for size in chunks or [1] * len(ids):
        out.append(detok.feed(ids[i : i + size]))
        i += size
    assert i == len(ids)
    out.append(detok.finish())
    return out


@pytest.mark.parametrize("name", ["smollm2", "byte_level", "sentencepiece"])
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_real_text_deltas_join_to_the_full_decode(
    request: pytest.FixtureRequest, name: str, skip_special_tokens: bool
) -> None:
    tokenizer: Tokenizer = request.getfixturevalue(name)
    rng = random.Random(0)
    for text in TEXTS:
        ids = tokenizer.encode(text).ids
        expected = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        one_by_one = deltas(Detokenizer(tokenizer, skip_special_tokens=skip_special_tokens), ids)
        assert "".join(one_by_one) == expected
        assert all("\ufffd" not in d for d in one_by_one), one_by_one
        chunks: list[int] = []
        while sum(chunks) < len(ids):
            chunks.append(min(rng.randint(1, 4), len(ids) - sum(chunks)))
        chunked = deltas(
            Detokenizer(tokenizer, skip_special_tokens=skip_special_tokens), ids, chunks
        )
        assert "".join(chunked) == expected


@pytest.mark.parametrize("name", ["smollm2", "byte_level"])
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_ids_deltas_join_to_the_full_decode(
    request: pytest.FixtureRequest, name: str, skip_special_tokens: bool
) -> None:
    """Any ids, invalid UTF-8 included: byte-level decoding is local, so even U+FFFD
    for bytes that never complete a character comes out as in the full decode."""
    tokenizer: Tokenizer = request.getfixturevalue(name)
    rng = random.Random(1)
    vocab_size = tokenizer.get_vocab_size()
    for _ in range(50):
        ids = [rng.randrange(vocab_size) for _ in range(rng.randint(1, 40))]
        expected = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        out = deltas(Detokenizer(tokenizer, skip_special_tokens=skip_special_tokens), ids)
        assert "".join(out) == expected, ids


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_pieces_and_byte_runs_join_to_the_full_decode(
    sentencepiece: Tokenizer, skip_special_tokens: bool
) -> None:
    """Random vocabulary pieces, special tokens and byte-fallback runs of random
    characters (accented, CJK, emoji)."""
    vocab = sentencepiece.get_vocab()
    pieces = [i for token, i in vocab.items() if not token.startswith("<0x")]
    chars = "aé中😀한ñ€"
    rng = random.Random(2)
    for _ in range(100):
        ids: list[int] = []
        while len(ids) < 30:
            if rng.random() < 0.3:
                utf8 = rng.choice(chars).encode()
                ids.extend(vocab[f"<0x{byte:02X}>"] for byte in utf8)
            else:
                ids.append(rng.choice(pieces))
        expected = sentencepiece.decode(ids, skip_special_tokens=skip_special_tokens)
        out = deltas(Detokenizer(sentencepiece, skip_special_tokens=skip_special_tokens), ids)
        assert "".join(out) == expected, ids
        assert all("\ufffd" not in d for d in out), out


def test_invalid_byte_fallback_run_streams_its_valid_bytes(sentencepiece: Tokenizer) -> None:
    """The one known difference from the full decode (vLLM and TGI have it too): the
    ByteFallback decoder turns a whole run of byte tokens into U+FFFD when any byte in
    it is invalid, so bytes already streamed as characters cannot be taken back."""
    vocab = sentencepiece.get_vocab()
    ids = [vocab["<0x51>"], vocab["<0x80>"], vocab["a"]]
    assert sentencepiece.decode(ids) == "\ufffd\ufffda"
    assert deltas(Detokenizer(sentencepiece), ids) == ["Q", "", "\ufffda", ""]


def test_emoji_split_over_two_tokens_is_held_until_complete(smollm2: Tokenizer) -> None:
    ids = smollm2.encode("Hi 😀!").ids
    assert [smollm2.decode([i]) for i in ids] == ["Hi", " \ufffd", "\ufffd", "!"]
    assert deltas(Detokenizer(smollm2), ids) == ["Hi", "", " 😀", "!", ""]


def test_several_ids_at_once_emit_up_to_the_incomplete_character(smollm2: Tokenizer) -> None:
    ids = smollm2.encode("Hi 😀!").ids
    detok = Detokenizer(smollm2)
    assert detok.feed(ids[:2]) == "Hi"
    assert detok.num_held_tokens == 1
    assert detok.feed(ids[2:]) == " 😀!"
    assert detok.num_held_tokens == 0


def test_byte_fallback_tokens_of_one_character(sentencepiece: Tokenizer) -> None:
    encoding = sentencepiece.encode("a 中")
    assert encoding.tokens == ["▁", "a", "▁", "<0xE4>", "<0xB8>", "<0xAD>"]
    assert deltas(Detokenizer(sentencepiece), encoding.ids) == ["", "a", " ", "", "", "中", ""]


def test_incomplete_character_at_the_end_is_flushed_as_the_full_decode_has_it(
    smollm2: Tokenizer,
) -> None:
    ids = smollm2.encode("Hi 😀").ids[:-1]
    detok = Detokenizer(smollm2)
    assert detok.feed(ids) == "Hi"
    assert detok.finish() == " \ufffd" == smollm2.decode(ids)[2:]
    assert detok.num_window_tokens == 0


def test_prompt_context_keeps_the_first_word_s_leading_space(sentencepiece: Tokenizer) -> None:
    prompt = sentencepiece.encode("The capital of France is").ids
    output = sentencepiece.encode("The capital of France is Paris.").ids[len(prompt) :]
    assert sentencepiece.decode(output) == "Paris."  # decoded alone, the space is gone
    assert "".join(deltas(Detokenizer(sentencepiece, prompt_ids=prompt), output)) == " Paris."
    short = Detokenizer(sentencepiece, prompt_ids=prompt[-2:])
    assert "".join(deltas(short, output)) == " Paris."
    assert "".join(deltas(Detokenizer(sentencepiece), output)) == "Paris."


def test_special_tokens_skipped_or_kept(smollm2: Tokenizer) -> None:
    ids = smollm2.encode("<|im_start|>assistant\nHi there<|im_end|>").ids
    assert ids[0] == 1 and ids[-1] == 2
    assert "".join(deltas(Detokenizer(smollm2), ids)) == "assistant\nHi there"
    kept = deltas(Detokenizer(smollm2, skip_special_tokens=False), ids)
    assert kept[0] == "<|im_start|>" and kept[-2] == "<|im_end|>"
    assert "".join(kept) == "<|im_start|>assistant\nHi there<|im_end|>"


def test_state_is_a_small_window_not_the_whole_output(smollm2: Tokenizer) -> None:
    ids = smollm2.encode(" ".join(TEXTS) * 20).ids
    detok = Detokenizer(smollm2)
    largest = 0
    for i in ids:
        detok.feed([i])
        largest = max(largest, detok.num_window_tokens)
    assert len(ids) > 1000 and largest <= 8
    detok.finish()
    assert detok.num_window_tokens == 0


@pytest.mark.parametrize("name", ["smollm2", "byte_level", "sentencepiece"])
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_a_cached_decoder_streams_the_same_deltas(
    request: pytest.FixtureRequest, name: str, skip_special_tokens: bool
) -> None:
    tokenizer: Tokenizer = request.getfixturevalue(name)
    cached = CachedDecoder(tokenizer)
    rng = random.Random(3)
    vocab_size = tokenizer.get_vocab_size()
    streams = [tokenizer.encode(text).ids for text in TEXTS]
    streams += [[rng.randrange(vocab_size) for _ in range(40)] for _ in range(20)]
    for ids in streams:
        plain = deltas(Detokenizer(tokenizer, skip_special_tokens=skip_special_tokens), ids)
        reused = deltas(Detokenizer(cached, skip_special_tokens=skip_special_tokens), ids)
        assert reused == plain, ids
    assert cached.decode([5, 6], skip_special_tokens) == tokenizer.decode(
        [5, 6], skip_special_tokens
    )


def test_a_cached_decoder_starts_over_when_full(smollm2: Tokenizer) -> None:
    class Small(CachedDecoder):
        MAX_ENTRIES = 4

    cached = Small(smollm2)
    for token in range(10):
        assert cached.decode([token]) == smollm2.decode([token])
    assert cached.decode([1], skip_special_tokens=False) == "<|im_start|>"
    assert cached.decode([1]) == ""


class PlainDecoder:
    """A TokenDecoder that is not a tokenizers.Tokenizer: the Detokenizer steps in Python."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def random_streams(tokenizer: Tokenizer, seed: int) -> list[list[int]]:
    """Token sequences: whole texts (accents, CJK, emoji, ZWJ sequences, combining marks)
    and slices of them that start or end inside a character, special tokens between
    them, and random vocabulary ids (byte tokens that never complete a character)."""
    rng = random.Random(seed)
    encoded = [tokenizer.encode(text, add_special_tokens=False).ids for text in TEXTS]
    added = tokenizer.get_added_tokens_decoder()
    special = [i for i, token in added.items() if token.special]
    vocab_size = tokenizer.get_vocab_size()
    streams = []
    for _ in range(60):
        ids: list[int] = []
        for _ in range(rng.randint(1, 6)):
            kind = rng.random()
            if kind < 0.4:
                ids += rng.choice(encoded)
            elif kind < 0.7:
                text = rng.choice(encoded)
                start = rng.randrange(len(text))
                ids += text[start : rng.randint(start + 1, len(text))]
            elif kind < 0.85:
                ids.append(rng.choice(special))
            else:
                ids += [rng.randrange(vocab_size) for _ in range(rng.randint(1, 4))]
        streams.append(ids)
    return streams


def random_chunks(rng: random.Random, num_ids: int) -> list[int]:
    chunks: list[int] = []
    while sum(chunks) < num_ids:
        chunks.append(min(rng.randint(1, 5), num_ids - sum(chunks)))
    return chunks


@pytest.mark.parametrize("name", ["smollm2", "qwen3"])
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decode_stream_deltas_are_the_full_decode_after_the_prompt_s_context(
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
    name: str,
    skip_special_tokens: bool,
) -> None:
    """The Rust path (a tokenizers.Tokenizer, or a CachedDecoder of one: the Python step
    is taken away) against decode(context + ids) minus decode(context), fed one by one
    and in chunks, after prompts that may end inside a character (then the context is
    left out: decode(ids))."""
    monkeypatch.delattr(detokenizer, "PythonDecodeStream")
    tokenizer: Tokenizer = request.getfixturevalue(name)
    cached = CachedDecoder(tokenizer)
    rng = random.Random(4)
    streams = random_streams(tokenizer, seed=5)
    for prompt, ids in zip(streams[::-1], streams, strict=True):
        context = prompt[-NUM_CONTEXT_TOKENS:]
        head = tokenizer.decode(context, skip_special_tokens=skip_special_tokens)
        if head.endswith("\ufffd"):
            context, head = [], ""
        whole = tokenizer.decode(context + ids, skip_special_tokens=skip_special_tokens)
        assert whole.startswith(head)
        expected = whole[len(head) :]
        for decoder in (tokenizer, cached):
            one_by_one = deltas(
                Detokenizer(decoder, skip_special_tokens=skip_special_tokens, prompt_ids=prompt),
                ids,
            )
            assert "".join(one_by_one) == expected, (prompt, ids)
            if "\ufffd" not in expected:
                assert all("\ufffd" not in d for d in one_by_one), one_by_one
            chunked = Detokenizer(
                decoder, skip_special_tokens=skip_special_tokens, prompt_ids=prompt
            )
            chunks = random_chunks(rng, len(ids))
            assert "".join(deltas(chunked, ids, chunks)) == expected, (prompt, ids, chunks)


@pytest.mark.parametrize("name", ["smollm2", "byte_level", "sentencepiece"])
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_a_decoder_that_is_not_a_tokenizer_streams_the_same_deltas(
    request: pytest.FixtureRequest, name: str, skip_special_tokens: bool
) -> None:
    """The Python step (for the tests' fakes) gives what DecodeStream gives, delta by
    delta, invalid byte-fallback runs included."""
    tokenizer: Tokenizer = request.getfixturevalue(name)
    plain = PlainDecoder(tokenizer)
    streams = random_streams(tokenizer, seed=6)
    for prompt, ids in zip(streams[::-1], streams, strict=True):
        for chunks in (None, random_chunks(random.Random(len(ids)), len(ids))):
            rust = Detokenizer(
                tokenizer, skip_special_tokens=skip_special_tokens, prompt_ids=prompt
            )
            python = Detokenizer(plain, skip_special_tokens=skip_special_tokens, prompt_ids=prompt)
            assert deltas(python, ids, chunks) == deltas(rust, ids, chunks), (prompt, ids)
