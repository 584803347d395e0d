"""Datasets: load and validate JSONL, Parquet or hub datasets; tokenise with prompt masking.

Validation errors read `path:ROW: field 'x': expected str, got int`, ROW being the 1-based
line of a JSONL file (the row number elsewhere), because datasets' own errors name neither.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from alignflow.core.errors import DataError
from alignflow.core.train.steps import step_pieces, step_sequence

log = logging.getLogger(__name__)

IGNORE_INDEX = -100  # label of tokens the loss skips (prompt and padding)

# field -> expected type; a tuple type is "list of"; "messages" is a chat conversation.
SCHEMAS: dict[str, dict[str, Any]] = {
    "prompt": {"prompt": str},
    "prompt_answer": {"prompt": str, "answer": str},
    "sft": {"prompt": str, "completion": str},
    "sft_messages": {"messages": "messages"},
    "pairwise": {"prompt": str, "chosen": str, "rejected": str},
    "unpaired": {"prompt": str, "completion": str, "label": bool},
    # a ranked list of completions of one prompt, best first; optional `scores`, one per completion, non-increasing
    "ranked": {"prompt": str, "completions": (str,)},
    # a label per step: 1/true = correct, 0/false = wrong, or a float in [0, 1] (Math-Shepherd's soft label)
    "steps": {"prompt": str, "steps": (str,), "step_labels": (int, bool, float)},
}


def _tname(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _is(value: Any, types: tuple) -> bool:
    # bool is an int subclass, but a label true where a count is expected (or 1 for a bool) is a bug.
    return isinstance(value, types) and (not isinstance(value, bool) or bool in types)


def _check_field(name: str, value: Any, expected: Any) -> str | None:
    """Why `value` does not fit `expected`, or None if it does."""
    if expected == "messages":
        if not isinstance(value, list) or not value:
            return f"field '{name}': expected a non-empty list of {{role, content}}, got {_tname(value)}"
        for i, m in enumerate(value):
            if not isinstance(m, dict) or not all(isinstance(m.get(k), str) for k in ("role", "content")):
                return f"field '{name}': item {i}: expected {{role: str, content: str}}, got {m!r:.60}"
        return None
    if isinstance(expected, tuple):  # list of
        label = "|".join(t.__name__ for t in expected)
        if not isinstance(value, list):
            return f"field '{name}': expected list[{label}], got {_tname(value)}"
        bad = next((i for i, v in enumerate(value) if not _is(v, expected)), None)
        if bad is not None:
            return f"field '{name}': item {bad}: expected {label}, got {_tname(value[bad])}"
        return None
    if not _is(value, (expected,)):
        return f"field '{name}': expected {expected.__name__}, got {_tname(value)}"
    return None


def check_row(row: Any, schema: str) -> str | None:
    """Why a row breaks `schema`, or None; for "sft", rows may hold messages instead."""
    if not isinstance(row, dict):
        return f"expected a JSON object, got {_tname(row)}"
    if schema == "sft" and "messages" in row:
        schema = "sft_messages"
    fields = SCHEMAS[schema]
    for name, expected in fields.items():
        if name not in row:
            return f"field '{name}': missing (expected fields: {', '.join(fields)})"
        problem = _check_field(name, row[name], expected)
        if problem:
            return problem
    if schema == "sft_messages" and row.get("tools") is not None:
        from alignflow.core.environments.chat import row_tools

        try:
            tools = row_tools(row["tools"])
        except (json.JSONDecodeError, TypeError) as e:
            return f"field 'tools': expected a list of JSON function schemas (or a JSON string of one): {e}"
        if not all(isinstance(t, dict) for t in tools or []):
            return "field 'tools': expected a list of JSON function schemas (objects)"
    if schema == "ranked":
        return _check_ranked(row)
    if schema == "steps" and len(row["steps"]) != len(row["step_labels"]):
        return f"field 'step_labels': {len(row['step_labels'])} labels for {len(row['steps'])} steps"
    if schema == "steps":
        bad = next((i for i, v in enumerate(row["step_labels"]) if not 0 <= v <= 1), None)
        if bad is not None:
            return f"field 'step_labels': item {bad}: expected a label in [0, 1], got {row['step_labels'][bad]}"
    return None


def _check_ranked(row: dict) -> str | None:
    m, scores = len(row["completions"]), row.get("scores")
    if m < 2:
        return f"field 'completions': expected a list of at least 2 completions, got {m}"
    if scores is None:
        return None
    problem = _check_field("scores", scores, (int, float))
    if problem or len(scores) != m:
        return problem or f"field 'scores': {len(scores)} scores for {m} completions"
    if any(a < b for a, b in zip(scores, scores[1:])):
        return f"field 'scores': expected the completions best first (non-increasing scores), got {scores}"
    return None


def iter_jsonl(path: Path) -> Iterator[tuple[int, Any]]:
    """(line number, value) for each non-blank line; invalid JSON raises `file:line: invalid JSON`."""
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{line_no}: invalid JSON: {e.msg} (column {e.colno})") from None
            yield line_no, value


def validate_jsonl(path: Path, schema: str, into: list | None = None) -> int:
    """One fast pass over a JSONL file; raises DataError at the first bad line. Returns the row count; the
    rows are appended to `into` if given."""
    if schema not in SCHEMAS:
        raise DataError(f"unknown schema {schema!r}: expected one of {', '.join(SCHEMAS)}")
    rows = 0
    for line_no, row in iter_jsonl(path):
        problem = check_row(row, schema)
        if problem:
            raise DataError(f"{path}:{line_no}: {problem}")
        rows += 1
        if into is not None:
            into.append(row)
    if rows == 0:
        raise DataError(f"{path}: empty dataset: no rows")
    return rows


def _validate_rows(where: str, rows: Iterable[dict], schema: str) -> None:
    n = 0
    for n, row in enumerate(rows, start=1):
        problem = check_row(row, schema)
        if problem:
            raise DataError(f"{where}:{n}: {problem}")
    if n == 0:
        raise DataError(f"{where}: empty dataset: no rows")


def load_rows(source: str | Path, schema: str, *, split: str = "train", name: str | None = None,
              cache_dir: str | None = None):
    """A validated `datasets.Dataset` from a .jsonl/.json, .parquet file or a hub dataset id."""
    from datasets import load_dataset

    if schema not in SCHEMAS:
        raise DataError(f"unknown schema {schema!r}: expected one of {', '.join(SCHEMAS)}")
    path = Path(source)
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json", ".parquet") and not path.is_file():
        raise DataError(f"{path}: no such file")
    if suffix in (".jsonl", ".json"):
        validate_jsonl(path, schema)
        return load_dataset("json", data_files=str(path), split="train", cache_dir=cache_dir)
    if suffix == ".parquet":
        ds, where = load_dataset("parquet", data_files=str(path), split="train", cache_dir=cache_dir), str(path)
    else:
        ds, where = load_dataset(str(source), name, split=split, cache_dir=cache_dir), f"{source}[{split}]"
    _validate_rows(where, (row for batch in ds.iter(batch_size=1024) for row in _unbatch(batch)), schema)
    return ds


def read_rows(source: str | Path, schema: str) -> list[dict]:
    """`load_rows(...).to_list()`, for a .jsonl file without `datasets` (~100 MB of imports and an Arrow table
    in a stage that only iterates the rows); keys a row lacks are None, as in Arrow's table."""
    path = Path(source)
    if path.suffix.lower() != ".jsonl" or not path.is_file():
        return load_rows(source, schema).to_list()
    rows: list[dict] = []
    validate_jsonl(path, schema, into=rows)
    keys = dict.fromkeys(k for row in rows for k in row)
    return [row if len(row) == len(keys) else {k: row.get(k) for k in keys} for row in rows]


def _unbatch(batch: dict[str, list]) -> Iterable[dict]:
    keys = list(batch)
    return (dict(zip(keys, values)) for values in zip(*batch.values()))


# --- tokenisation ---------------------------------------------------------------------------

OK, TRUNCATED, DROPPED = 0, 1, 2


def split_messages(tokenizer, messages: list[dict]) -> tuple[str, str]:
    """(prompt, completion) text of a conversation whose last turn, the completion, is the assistant's."""
    if messages[-1]["role"] != "assistant":
        raise ValueError(f"the last message must be the assistant's, got role {messages[-1]['role']!r}")
    prompt = tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    if not full.startswith(prompt):
        raise ValueError("the chat template renders the conversation without its prompt as a prefix")
    return prompt, full[len(prompt):]


def truncate(prompt_ids: list[int], completion_ids: list[int], max_length: int):
    """(input_ids, labels, status): the completion cut from the right; dropped if the prompt fills it all."""
    if len(prompt_ids) >= max_length:
        return [], [], DROPPED
    room = max_length - len(prompt_ids)
    status = TRUNCATED if len(completion_ids) > room else OK
    completion_ids = completion_ids[:room]
    return prompt_ids + completion_ids, [IGNORE_INDEX] * len(prompt_ids) + completion_ids, status


def conversation_ids(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> tuple[list[int], list[int]]:
    """(ids, labels) of a conversation with several assistant turns (or with `tools`), built as a rollout
    builds an episode (core/environments/chat.py `replay`): every assistant turn labelled, the messages
    between them not, the tools' schemas rendered where the template puts them."""
    from alignflow.core.environments.chat import replay

    transcript = replay(tokenizer, messages, tools)
    labels = [IGNORE_INDEX] * len(transcript.prompt_ids)
    labels += [t if m else IGNORE_INDEX for t, m in zip(transcript.ids, transcript.mask)]
    return transcript.prompt_ids + transcript.ids, labels


def truncate_labelled(ids: list[int], labels: list[int], max_length: int):
    """(input_ids, labels, status) of a labelled sequence cut from the right; dropped if nothing labelled is left."""
    if not any(x != IGNORE_INDEX for x in labels[:max_length]):
        return [], [], DROPPED
    return ids[:max_length], labels[:max_length], TRUNCATED if len(ids) > max_length else OK


def _completions(tokenizer, texts: list[str]) -> list[list[int]]:
    """Completion token ids, each ending in EOS (once) so the model learns to stop."""
    eos = tokenizer.eos_token_id
    ids = tokenizer(texts, add_special_tokens=False).input_ids
    return [x + [eos] if eos is not None and (not x or x[-1] != eos) else x for x in ids]


def _prompts(tokenizer, batch: dict[str, list]) -> tuple[list[list[int]], list[str] | None]:
    """Prompt ids and, for chat rows, the completion text the template gives the last turn."""
    if "messages" not in batch:
        return tokenizer(batch["prompt"]).input_ids, None
    pairs = [split_messages(tokenizer, m) for m in batch["messages"]]
    # The template already wrote any BOS it wants, so add none on top.
    return tokenizer([p for p, _ in pairs], add_special_tokens=False).input_ids, [c for _, c in pairs]


def _sft_batch(batch, tokenizer, max_length):
    from alignflow.core.environments.chat import row_tools  # chat rows' tools, rendered as episodes render them

    prompts, chat_completions = _prompts(tokenizer, batch)
    completions = _completions(tokenizer, chat_completions or batch["completion"])
    out = {"input_ids": [], "labels": [], "_status": []}
    for i, (p, c) in enumerate(zip(prompts, completions)):
        messages = batch["messages"][i] if "messages" in batch else None
        tools = row_tools(batch["tools"][i]) if "tools" in batch else None
        if messages is not None and (tools or sum(m["role"] == "assistant" for m in messages) > 1):
            row = truncate_labelled(*conversation_ids(tokenizer, messages, tools), max_length)
        else:
            row = truncate(p, c, max_length)
        for key, value in zip(("input_ids", "labels", "_status"), row):
            out[key].append(value)
    if "label" in batch:  # unpaired rows keep their desirable/undesirable label
        out["label"] = batch["label"]
    return out


def _completion_sets(batch, tokenizer, max_length, sets: dict[str, list[str]]) -> dict:
    """Each prompt with each set's completion: `{set}_input_ids`, `{set}_labels`; a row's worst status."""
    prompts = tokenizer(batch["prompt"]).input_ids
    out = {"_status": [OK] * len(prompts)}
    for name, texts in sets.items():
        rows = [truncate(p, c, max_length) for p, c in zip(prompts, _completions(tokenizer, texts))]
        out[f"{name}_input_ids"], out[f"{name}_labels"] = [r[0] for r in rows], [r[1] for r in rows]
        out["_status"] = [max(status, r[2]) for status, r in zip(out["_status"], rows)]
    return out


def _pairwise_batch(batch, tokenizer, max_length):
    out = _completion_sets(batch, tokenizer, max_length, {side: batch[side] for side in ("chosen", "rejected")})
    if "margin" in batch:  # reward-model rows may carry a per-pair margin (Llama 2)
        out["margin"] = batch["margin"]
    return out


def candidate(k: int) -> str:
    """The sequence-set name of the k-th completion of a ranked list (0: the best)."""
    return f"candidate{k}"


def _ranked_batch(batch, tokenizer, max_length):
    m = len(batch["completions"][0])  # the same in every row (`list_size`)
    sets = {candidate(k): [c[k] for c in batch["completions"]] for k in range(m)}
    out = _completion_sets(batch, tokenizer, max_length, sets)
    if "scores" in batch:
        out["scores"] = [[float(x) for x in s] for s in batch["scores"]]
    return out


def list_size(ds, where: str) -> int:
    """The one length of every ranked row's list (a micro-batch stacks them), and its scores all or none."""
    sizes = [len(c) for c in ds["completions"]]
    bad = next((i for i, n in enumerate(sizes) if n != sizes[0]), None)
    if bad is not None:
        raise DataError(f"{where}: row {bad + 1}: {sizes[bad]} completions, but row 1 has {sizes[0]}: every "
                        "ranked list of a dataset must have the same length")
    scores = ds["scores"] if "scores" in ds.column_names else [None]
    if any(s is None for s in scores) and any(s is not None for s in scores):
        row = next(i for i, s in enumerate(scores) if s is None)
        raise DataError(f"{where}: row {row + 1}: no 'scores', which other rows have: give every row scores or none")
    return sizes[0]


def _steps_batch(batch, tokenizer, max_length, separator):
    """Steps each followed by `separator`; a step's label (a float) sits on its last token, the rest is -100."""
    prompts = tokenizer(batch["prompt"]).input_ids
    out = {"input_ids": [], "labels": [], "_status": []}
    for p, steps, step_labels in zip(prompts, batch["steps"], batch["step_labels"]):
        ids, ends = step_sequence(p, step_pieces(tokenizer, steps, separator))
        labels = [float(IGNORE_INDEX)] * len(ids)
        for end, label in zip(ends, step_labels):
            labels[end] = float(label)
        status = DROPPED if len(p) >= max_length else TRUNCATED if len(ids) > max_length else OK
        out["input_ids"].append(ids[:max_length] if status != DROPPED else [])
        out["labels"].append(labels[:max_length] if status != DROPPED else [])
        out["_status"].append(status)
    return out


TOKENIZERS: dict[str, Callable] = {
    "sft": _sft_batch, "unpaired": _sft_batch, "pairwise": _pairwise_batch, "steps": _steps_batch,
    "ranked": _ranked_batch,
}


def _tokenizer_digest(tokenizer) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    state = backend.to_str() if backend is not None else repr(sorted(tokenizer.get_vocab().items()))
    extra = [tokenizer.chat_template, tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token]
    return hashlib.sha256((state + json.dumps(extra)).encode()).hexdigest()


def tokenize(ds, tokenizer, max_length: int, kind: str = "sft", *, step_separator: str = "\n",
             source: str = "rows"):
    """Tokenise rows of a schema for training: (dataset, {"rows", "truncated", "dropped"}).

    Prompt tokens are labelled -100; a completion longer than the room left is cut from the right;
    a row whose prompt alone fills `max_length` is dropped. The map is cached under a fingerprint
    of the input dataset, tokenizer, kind and max_length. `source` names the rows in errors.
    """
    if kind not in TOKENIZERS:
        raise DataError(f"cannot tokenise {kind!r} rows: expected one of {', '.join(TOKENIZERS)}")
    if kind == "ranked":
        list_size(ds, source)
    kwargs = {"tokenizer": tokenizer, "max_length": max_length}
    if kind == "steps":
        kwargs["separator"] = step_separator
    key = json.dumps([ds._fingerprint, _tokenizer_digest(tokenizer), kind, max_length, step_separator])
    mapped = ds.map(TOKENIZERS[kind], batched=True, fn_kwargs=kwargs, remove_columns=ds.column_names,
                    new_fingerprint=hashlib.sha256(key.encode()).hexdigest()[:16],
                    desc=f"tokenise {kind}")
    status = list(mapped["_status"])
    stats = {"rows": len(status), "truncated": status.count(TRUNCATED), "dropped": status.count(DROPPED)}
    log.info("tokenised %d %s rows (max_length %d): %d truncated, %d dropped",
             stats["rows"], kind, max_length, stats["truncated"], stats["dropped"])
    kept = mapped.filter(lambda s: s != DROPPED, input_columns="_status") if stats["dropped"] else mapped
    return kept.remove_columns("_status"), stats
