"""A training file as the preflight command reads it: .jsonl or .parquet rows with a ``text`` or
``messages`` column, tokenised as the run would tokenise them."""

from __future__ import annotations

from typing import Optional


def read_examples(path: str, limit: Optional[int] = None) -> list[dict]:
    """Rows of a .jsonl or .parquet file (a ``text`` or ``messages`` column)."""
    import json
    from pathlib import Path

    from ..recipe import RecipeError

    p = Path(path)
    if not p.is_file():
        raise RecipeError(f"{path}: no such file")
    if p.suffix == ".parquet":
        import pyarrow.parquet as pq

        rows = pq.read_table(p).to_pylist()
    else:
        rows = []
        with p.open(encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rows.append(json.loads(line))
                except ValueError as exc:
                    raise RecipeError(f"{path}:{n}: invalid JSON: {exc}") from None
                if limit is not None and len(rows) >= limit:
                    break
    for n, row in enumerate(rows, 1):
        if not isinstance(row, dict) or not ({"text", "messages"} & row.keys()):
            raise RecipeError(f"{path}:{n}: a row needs a 'text' or 'messages' column")
    if not rows:
        raise RecipeError(f"{path}: no rows")
    return rows


def tokenize(rows: list[dict], tokenizer, max_length: Optional[int]) -> list[dict]:
    out = []
    for row in rows:
        if "messages" in row and row["messages"] is not None:
            ids = tokenizer.apply_chat_template(row["messages"], tokenize=True)
            ids = ids["input_ids"] if hasattr(ids, "keys") else ids  # transformers 5 returns a BatchEncoding
        else:
            ids = tokenizer(row["text"])["input_ids"]
        if max_length:
            ids = ids[:max_length]
        out.append({"input_ids": list(ids)})
    return out
