"""The scheduler's tokenizer, loaded only when a request first needs it.

Only stop strings (text to match) and grammars (the vocabulary xgrammar compiles against) need a
tokenizer in the scheduler. Importing transformers and loading a tokenizer through it costs
seconds of a server's start, so the scheduler process is handed the tokenizer's directory and
loads it late: stop strings decode with the tokenizers library alone where that gives
transformers' text (models/text_decoder.py, a fraction of a second), and the transformers
tokenizer is loaded for the first grammar.
"""

from __future__ import annotations

from typing import Any

from radixserve.config.server_args import ServerArgs


class SchedulerTokenizer:
    def __init__(self, tokenizer: Any, args: ServerArgs) -> None:
        """tokenizer: one already loaded, or the directory to load it from, or None (then from
        the model's source, --tokenizer-path first)."""
        self._tokenizer = tokenizer
        self._decoder: Any = None
        self._args = args

    def full(self) -> Any:
        """The transformers tokenizer (for grammars)."""
        if isinstance(self._tokenizer, str):
            from radixserve.models.tokenizer import load_tokenizer_dir

            self._tokenizer = load_tokenizer_dir(self._tokenizer)
        elif self._tokenizer is None:
            from radixserve.models.source import resolve_model_source
            from radixserve.models.tokenizer import load_tokenizer

            self._tokenizer = load_tokenizer(
                resolve_model_source(self._args.tokenizer_path or self._args.model_path)
            )
        return self._tokenizer

    def decode(self, ids: list[int]) -> str:
        """The text of ids (for stop strings), as transformers' decode gives it."""
        if self._decoder is None:
            from radixserve.models.text_decoder import fast_decoder

            found = fast_decoder(self._tokenizer) if isinstance(self._tokenizer, str) else None
            self._decoder = found if found is not None else self.full()
        text: str = self._decoder.decode(ids)
        return text
