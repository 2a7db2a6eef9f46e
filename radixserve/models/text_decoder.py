"""Decoding ids to text without transformers, for processes that need nothing else of a tokenizer.

Kept apart from tokenizer.py, whose loading imports transformers: this module imports it only
when it has to fall back to it.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from radixserve.models.heap import release_freed_heap

logger = logging.getLogger("radixserve")


class TokenizersDecoder:
    """Decoding with the `tokenizers` library alone, for processes that only turn ids into text
    (the detokenizer): loading transformers and a tokenizer through it takes seconds of every
    start, this a fraction of one. It decodes as transformers' fast tokenizer does where that
    applies no clean-up of spaces (load_decoder checks), which is the backend's decode itself;
    spaces_between_special_tokens, as there, does not apply to a fast tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def decode(
        self, ids: list[int], skip_special_tokens: bool = False, spaces_between_special_tokens: bool = True
    ) -> str:
        text: str = self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        return text


def fast_decoder(tokenizer_dir: str) -> TokenizersDecoder | None:
    """A TokenizersDecoder for a saved tokenizer directory, where its tokenizer.json decodes exactly
    as transformers would (no clean-up of spaces applies); None where it would not."""
    path = Path(tokenizer_dir)
    try:
        config = json.loads((path / "tokenizer_config.json").read_text())
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        release_freed_heap()  # the parse of tokenizer.json: transient, and larger than the tokenizer
    except Exception as exc:  # OSError, bad JSON, or what the tokenizers library raises (Exception)
        logger.debug("no tokenizers-only decoder for %s: %s", path, exc)
        return None
    # transformers cleans up spaces only when the config asks and the model is not BPE.
    cleans_up = config.get("clean_up_tokenization_spaces", False) and (
        type(tokenizer.model).__name__ != "BPE"
        or config.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)
    )
    return None if cleans_up else TokenizersDecoder(tokenizer)


def load_decoder(tokenizer_dir: str) -> Any:
    """What decodes ids for a saved tokenizer directory: fast_decoder's where it can, else the
    transformers tokenizer itself (logged)."""
    decoder = fast_decoder(tokenizer_dir)
    if decoder is not None:
        return decoder
    from radixserve.models.tokenizer import load_tokenizer_dir

    logger.info("decoding through transformers' tokenizer (it cleans up spaces, or has no tokenizer.json)")
    return load_tokenizer_dir(tokenizer_dir)
