from __future__ import annotations

from typing import Any

from radixserve.protocol.messages import DetokenizeParams, FinishReason, OutputBatch, ReqOutput
from radixserve.runtime.detokenizer import DetokenizerManager, IncrementalDetokenizer, held_back_length


def test_incremental_text_equals_full_decode_with_multibyte_characters(tiny_tokenizer: Any) -> None:
    text = "naïve café — 日本語 ✓ done"
    ids = tiny_tokenizer.encode(text)
    detok = IncrementalDetokenizer(tiny_tokenizer)
    deltas = [detok.push([i]) for i in ids[:-1]] + [detok.push([ids[-1]], final=True)]
    assert "".join(deltas) == tiny_tokenizer.decode(ids) == text
    # Byte-level BPE splits multi-byte characters; a half character is never emitted.
    assert all("\ufffd" not in d for d in deltas)


def _outputs(ids: list[int], finish: FinishReason, params: DetokenizeParams) -> list[ReqOutput]:
    outs = [ReqOutput("r", [i], None, 1, n + 1, 0, params) for n, i in enumerate(ids)]
    outs[-1].finished_reason = finish
    return outs


def test_held_back_length_finds_the_longest_stop_prefix() -> None:
    assert held_back_length("hello wor", ["world"]) == 3
    assert held_back_length("hello", ["world", "lo!"]) == 2
    assert held_back_length("abc", ["xyz"]) == 0
    assert held_back_length("", ["a"]) == 0


def test_stop_strings_are_held_back_while_streaming_and_trimmed_at_the_end(tiny_tokenizer: Any) -> None:
    ids = tiny_tokenizer.encode("alpha beta gamma delta")
    text = tiny_tokenizer.decode(ids)
    stop = "ta gam"  # spans the token boundary between "beta" and "gamma"
    manager = DetokenizerManager(tiny_tokenizer)
    params = DetokenizeParams(stop=[stop])
    deltas = [
        manager.handle(OutputBatch([o])).outputs[0].text_delta
        for o in _outputs(ids, FinishReason("stop", matched=stop), params)
    ]
    assert "".join(deltas) == text[: text.index(stop)]
    assert manager.requests == {}  # finished requests are forgotten

    kept = DetokenizerManager(tiny_tokenizer)
    no_trim = DetokenizeParams(stop=[stop], no_stop_trim=True)
    outs = _outputs(ids, FinishReason("stop", matched=stop), no_trim)
    assert "".join(kept.handle(OutputBatch([o])).outputs[0].text_delta for o in outs) == text


def test_a_matched_stop_token_is_not_part_of_the_text(tiny_tokenizer: Any) -> None:
    ids = tiny_tokenizer.encode("one two three")
    manager = DetokenizerManager(tiny_tokenizer)
    outs = _outputs(ids, FinishReason("stop", matched=ids[-1]), DetokenizeParams())
    text = "".join(manager.handle(OutputBatch([o])).outputs[0].text_delta for o in outs)
    assert text == tiny_tokenizer.decode(ids[:-1])


_PIECES = {1: "<s>", 2: "a", 3: "b"}


class _SlowStyleTokenizer:
    """Decodes like a slow (Python) HF tokenizer: special tokens joined with spaces on request."""

    def decode(self, ids: list[int], skip_special_tokens: bool, spaces_between_special_tokens: bool) -> str:
        parts = [_PIECES[i] for i in ids if not (skip_special_tokens and i == 1)]
        return (" " if spaces_between_special_tokens else "").join(parts)


def test_spaces_between_special_tokens_reaches_the_tokenizer() -> None:
    for spaces, expected in ((True, "a <s> b"), (False, "a<s>b")):
        detok = IncrementalDetokenizer(
            _SlowStyleTokenizer(), skip_special_tokens=False, spaces_between_special_tokens=spaces
        )
        assert "".join(detok.push([i]) for i in (2, 1, 3)) + detok.push([], final=True) == expected
