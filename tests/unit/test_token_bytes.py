"""TokenBytes: each token's raw bytes, so that joining them gives the text's UTF-8."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models

from lmd.tokenizer.text.token_bytes import TokenBytes, byte_level_table

QWEN3 = Path(__file__).resolve().parents[3] / "shared/assets/tokenizers/qwen3/tokenizer.json"


def test_the_byte_level_table_is_a_bijection_over_all_256_bytes() -> None:
    table = byte_level_table()
    assert sorted(table.values()) == list(range(256))
    assert table["A"] == ord("A") and table["\u0120"] == ord(" ")  # "Ġ" stands for a space


@pytest.fixture(scope="module")
def llama2_style() -> Tokenizer:
    """A sentencepiece-style vocabulary with byte fallback, as Llama 2 and Mistral have."""
    vocab = {"<unk>": 0, "<0xF0>": 1, "<0x9F>": 2, "<0x8E>": 3, "<0x89>": 4, "\u2581hi": 5}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("\u2581", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tok.add_special_tokens([AddedToken("<|eot|>", special=True)])
    return tok


def test_byte_fallback_tokens_are_their_byte_and_metaspace_a_space(llama2_style: Tokenizer) -> None:
    raw = TokenBytes(llama2_style)
    assert llama2_style.decode([1]) == "\ufffd"  # what the old code reported the bytes of
    assert b"".join(bytes(raw(i)) for i in (1, 2, 3, 4)) == "🎉".encode()
    assert raw(5) == list(b" hi")  # the leading space a lone decode strips is kept
    assert raw(6) == list(b"<|eot|>")


def test_byte_level_pieces_of_an_emoji_join_to_its_utf8(smollm2_dir: Path) -> None:
    tok = Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    raw = TokenBytes(tok)
    text = "🎉 ok, café"
    ids = tok.encode(text, add_special_tokens=False).ids
    assert any(tok.decode([i]) == "\ufffd" for i in ids)  # the emoji is split
    assert b"".join(bytes(raw(i)) for i in ids) == text.encode()


@pytest.mark.skipif(not QWEN3.exists(), reason="the Qwen3 tokenizer asset is not here")
def test_special_tokens_are_the_utf8_of_their_text() -> None:
    tok = Tokenizer.from_file(str(QWEN3))
    raw = TokenBytes(tok)
    eos = tok.token_to_id("<|im_end|>")
    assert eos is not None
    assert raw(eos) == list(b"<|im_end|>")
    ids = tok.encode("Grüße 🎉", add_special_tokens=False).ids
    assert b"".join(bytes(raw(i)) for i in ids) == "Grüße 🎉".encode()
