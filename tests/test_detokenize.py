from __future__ import annotations

from typing import Any

from radixserve.detokenize import IncrementalDetokenizer


def test_incremental_text_equals_full_decode_with_multibyte_characters(tiny_tokenizer: Any) -> None:
    text = "naïve café — 日本語 ✓ done"
    ids = tiny_tokenizer.encode(text)
    detok = IncrementalDetokenizer(tiny_tokenizer)
    deltas = [detok.push([i]) for i in ids[:-1]] + [detok.push([ids[-1]], final=True)]
    assert "".join(deltas) == tiny_tokenizer.decode(ids) == text
    # Byte-level BPE splits multi-byte characters; a half character is never emitted.
    assert all("\ufffd" not in d for d in deltas)
