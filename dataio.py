"""
dataio.py: the data files every script reads and writes, and their checks.

    <data>/kb/{text,table,image}.jsonl, <data>/questions/<split>.jsonl
    (the layout: corpus.py's docstring)

JSONL with loud errors (path:line, the field and the type it should have), atomic writes (a temp
file, then a rename: an interrupted run never leaves half a file), and the KB and question schemas
load_kb and load_questions validate.
"""
import json
import os
from dataclasses import dataclass
from pathlib import Path

@dataclass(frozen=True)
class KB:
    """One knowledge base type, all a script knows of it: a new type is a row of KB_TABLE (and its
    documents, from the world or an importer), nowhere else."""
    name: str       # its file kb/<name>.jsonl and a step's "kb"
    retriever: str  # what the policy writes in <ret> (R1-Router's retriever names)
    tag: str        # how R1-Router's released prompts and data label its passages
                    # ("ter-0: ...")
    about: str      # the system prompt's gloss of what it holds
    fields: dict    # a document's required fields and their types
    body: str       # the field a document is indexed by and shown as evidence, after its
                    # title

KB_TABLE = (
    KB("text", "Text Retriever", "ter", "text: encyclopedia passages",
       {"id": str, "title": str, "text": str}, "text"),
    KB("table", "Table Retriever", "tar", "table: facts, figures and records",
       {"id": str, "title": str, "header": list, "rows": list, "text": str}, "text"),
    KB("image", "Text Image Retriever", "tir", "text image: what things look like",
       {"id": str, "title": str, "caption": str, "path": str}, "caption"),
)
KBS = tuple(kb.name for kb in KB_TABLE)  # ("text", "table", "image"): the order every loop over
                                         # the KBs takes
KB_OF = {kb.name: kb for kb in KB_TABLE}

class DataError(ValueError):
    pass

def json_error(e):
    """A JSONDecodeError in words: 'Expecting value at column 14' ('Unterminated string starting at
    column 23')."""
    return f"{e.msg.removesuffix(' at')} at column {e.colno}"

def iter_jsonl(path):
    """(lineno, row) for each non-blank line."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: file not found")
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                # with the newline, a cut-off line's error is "line 2, column 1"
                row = json.loads(line.rstrip("\r\n"))
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: not valid JSON ({json_error(e)})") from None
            if not isinstance(row, dict):
                raise DataError(f"{path}:{lineno}: expected a JSON object, got "
                                f"{type(row).__name__}")
            yield lineno, row

def read_jsonl(path):
    return [row for _, row in iter_jsonl(path)]

def write_atomic(path, data):
    """Write str or bytes to a temp file next to `path`, fsync, then os.replace: readers never see
    half a file. The one file writer of the repo (JSONL, reports, figures, checkpoint pointers)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)

def write_jsonl(path, rows):
    """Rows are dicts or Mappings (a rollout.Trajectory is written as its row: default=dict)."""
    lines = (json.dumps(row, ensure_ascii=False, default=dict) + "\n" for row in rows)
    write_atomic(path, "".join(lines))

# required keys and their types, per file kind (a key ending in "?" is optional)
SCHEMA = {
    **{kb.name: kb.fields for kb in KB_TABLE},
    "question": {"id": str, "question": str, "answers": list, "type": str, "steps": list,
                 "image?": str},
    "step": {"sub_question": str, "kb": str, "doc_id": str, "answer": str},
}

def check_row(row, kind, where):
    for spec, typ in SCHEMA[kind].items():
        key = spec.rstrip("?")
        if key not in row and spec.endswith("?"):
            continue
        if key not in row:
            raise DataError(f"{where}: missing field '{key}' (a {kind} row needs "
                            f"{[k for k in SCHEMA[kind] if k[-1] != '?']})")
        if not isinstance(row[key], typ):
            raise DataError(f"{where}: field '{key}' should be {typ.__name__}, got "
                            f"{type(row[key]).__name__}")
    if kind == "question":
        if not row["answers"] or not all(isinstance(a, str) for a in row["answers"]):
            raise DataError(f"{where}: 'answers' must be a non-empty list of strings")
        for i, step in enumerate(row["steps"]):
            if not isinstance(step, dict):
                raise DataError(f"{where}: steps[{i}] should be an object")
            check_row(step, "step", f"{where} steps[{i}]")
            if step["kb"] not in KBS:
                raise DataError(f"{where} steps[{i}]: kb '{step['kb']}' is not one of {KBS}")

def _load(path, kind):
    rows = read_jsonl(path)
    seen = set()
    for i, row in enumerate(rows):
        where = f"{path}: row {i + 1} (id {row.get('id')!r})"
        check_row(row, kind, where)
        if row["id"] in seen:
            raise DataError(f"{where}: duplicate id")
        seen.add(row["id"])
    return rows

def load_kb(data_dir, kb):
    """Documents of one KB, validated. Image rows get an absolute `path` to an existing file."""
    path = Path(data_dir) / "kb" / f"{kb}.jsonl"
    rows = _load(path, kb)
    if kb == "image":
        for i, r in enumerate(rows, 1):
            # absolute: the server sends it to every node
            r["path"] = str(Path(data_dir).resolve() / "kb" / r["path"])
            if not Path(r["path"]).is_file():
                raise DataError(f"{path}: row {i} (id {r['id']!r}): image file not found: "
                                f"{r['path']}")
    return rows

def load_questions(data_dir, split):
    """Questions of one split, validated. A visual question's `image` becomes an absolute path to
    an existing file."""
    path = Path(data_dir) / "questions" / f"{split}.jsonl"
    rows = _load(path, "question")
    for i, q in enumerate(rows):
        if "image" in q:
            q["image"] = str(Path(data_dir).resolve() / q["image"])
            if not Path(q["image"]).is_file():
                raise DataError(f"{path}: row {i + 1} (id {q['id']!r}): image file not found: "
                                f"{q['image']}")
    return rows
