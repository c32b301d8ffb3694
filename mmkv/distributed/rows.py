"""Rows of batch Q&A (``batch.answer``): a row's values, what is wrong with it, and each row's
key (``affinity.py``, or its prompt's ``prefix_index.PrefixRoute``), computed where the row is
keyed; ``placement.Placement`` places rows by these keys."""

from __future__ import annotations

from typing import Any

import pandas as pd

from mmkv.distributed.affinity import image_affinity, shared_prefix_affinity
from mmkv.distributed.prefix_index import RouteKey, prefix_route
from vision import ImageError

KEY = "affinity"


def row_value(batch: pd.DataFrame, column: str, i: int) -> Any:
    """The row's value, None where the column is missing or the value is null."""
    if column not in batch.columns:
        return None
    value = batch[column].iloc[i]
    return None if pd.api.types.is_scalar(value) and pd.isna(value) else value


def row_error(prompt: Any, question: Any, image: Any, shared_prefix: Any = None) -> str | None:
    if (prompt is None) == (question is None):
        return "a row needs exactly one of 'prompt' and 'question'"
    if question is not None and image is None:
        return "a 'question' row needs an 'image'; send a 'prompt' for text"
    if shared_prefix is not None and not (isinstance(shared_prefix, str) and isinstance(prompt, str)
                                          and prompt.startswith(shared_prefix)):
        return "a row's 'shared_prefix' must be a string that its 'prompt' starts with"
    return None


class AffinityKeys:
    """Adds each row's key, and ``error`` for a row whose image or shape is bad: its image's key,
    else its ``shared_prefix``'s, else the ``PrefixRoute`` of its prompt's first ``prefix_tokens``
    tokens (by ``tokenizer``)."""

    def __init__(self, tokenizer: Any, prefix_tokens: int) -> None:
        self.tokenizer, self.prefix_tokens = tokenizer, prefix_tokens

    def __call__(self, batch: pd.DataFrame) -> pd.DataFrame:
        keys: list[RouteKey] = []
        errors: list[str | None] = []
        for i in range(len(batch)):
            prompt, question, image, salt, shared = (
                row_value(batch, c, i) for c in ("prompt", "question", "image", "cache_salt", "shared_prefix"))
            error = row_error(prompt, question, image, shared)
            key: RouteKey = ""
            if error is None and image is not None:
                try:
                    key = image_affinity(image, salt)
                except ImageError as err:
                    error = str(err)
            elif error is None and shared is not None:
                key = shared_prefix_affinity(shared, salt)
            elif error is None:
                key = prefix_route(self.tokenizer.encode(prompt), salt, self.prefix_tokens)
            keys.append(key)
            errors.append(error)
        return batch.assign(**{KEY: keys, "error": errors})

