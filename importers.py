"""
importers.py: the public benchmarks, as researchers download them, converted into this repo's data
layout (corpus.py: kb/{text,table,image}.jsonl + questions/<split>.jsonl), several merged into one
data folder.

    python importers.py --out data/hotpot --hotpotqa hotpot_dev_distractor_v1.json --limit 1000
    python importers.py --out data/multihop --hotpotqa hotpot_dev=hotpot_dev_distractor_v1.json \\
        --twowiki 2wiki_dev=2wikimultihopqa/dev.json --musique musique_ans_v1.0_dev.jsonl \\
        --questions bamboogle=bamboogle/test.jsonl --corpus text=wiki18_100w.jsonl
    python importers.py --out data/tables \\
        --wtq WikiTableQuestions/data/pristine-unseen-tables.tsv \\
        --tabfact Table-Fact-Checking/collected_data/r2_training_all.json \\
        --tabfact_tables Table-Fact-Checking/data/all_csv \\
        --openwikitable Open-WikiTable/data/test.json \\
        --openwikitable_tables Open-WikiTable/data/splitted_tables.json
    python importers.py --bundle /path/to/data --out data/real  # the folder `make real` reads
                                                                (import_bundle below)
    python retrievers.py build --data data/hotpot && \\
        python evaluate.py --data data/hotpot --split hotpotqa ...

Each question flag takes [SPLIT=]PATH and may repeat; SPLIT (questions/SPLIT.jsonl) defaults to the
format's name.
  --hotpotqa   HotpotQA, the official JSON list ({_id, question, answer, supporting_facts, context,
               type}), FlashRAG's JSONL ({id, question, golden_answers, metadata: {context,
               supporting_facts}}) or IRCoT's JSONL ({question_id, question_text, answers_objects,
               contexts}). Every paragraph goes to the text KB; one gold step per supporting
               paragraph, no sub-question (unordered: evaluate.py counts it hit when any retrieval
               step finds it)
  --twowiki    2WikiMultihopQA in the same three forms; its evidence triples (s, r, o) become the
               gold steps, one each: "What is the r of s?" -> o, on the supporting paragraph about s
  --musique    MuSiQue, official or FlashRAG JSONL: the decomposition, "#k" replaced by step k's
               answer; unanswerable rows (MuSiQue-Full) are left out
  --questions  questions only ({question, golden_answers}: FlashRAG, Bamboogle; or {question,
               answer(s)}): no gold steps, answered against the KBs given with them
  --wtq        WikiTableQuestions tsv (id, utterance, context, targetValue); its csv tables -> the
               table KB
  --tabfact    TabFact statements ({"<table>.html.csv": [statements, labels, caption]}) with
               --tabfact_tables (its all_csv folder, '#'-separated): "Is it true that <statement>?"
               -> yes / no, one table step
  --openwikitable  Open-WikiTable questions (pandas JSON or records) with --openwikitable_tables
               (splitted_tables.json): every table chunk -> the table KB; gold step: the first
               hard-positive chunk
  --r1router   the folder of R1-Router's released question sets (questions and answers only), + the
               visual ones given their pictures (--infoseek_images, --dynvqa_images, --webqa_images:
               <image_id>.jpg, ...)
  --corpus     KB=PATH: a JSONL corpus, {id, title, text} or FlashRAG / Search-R1's {id, contents:
               "title\\ntext"}, streamed line by line into that KB (an image KB row also needs
               `path`, its picture)
A table keeps its first 30 rows (its text says how many were cut). Text paragraphs are deduplicated
on (title, text) with stable ids ("text-" + sha1); a corpus keeps its own ids. Errors name the file,
line or key and what was expected, and nothing is written unless all of it converts (the folder is
built aside and swapped in).
"""
import argparse
import csv
import hashlib
import itertools
import json
import os
import random
import re
import shutil
import sys
from pathlib import Path

from corpus import linearise
from dataio import KB_OF, KBS, DataError, check_row, iter_jsonl, json_error

MAX_ROWS = 30  # longer tables keep their first 30 rows
# a visual question's picture is <image_id> + one of these
IMAGE_EXTS = (".jpg", ".jpeg", ".png", ".webp")
R1_SETS = {"r1_2wiki": "2wikimultihopqa_val.jsonl", "r1_openwikitqa": "openwikitqa_val.jsonl",
           "r1_tabfact": "tabfact_val.jsonl"}
R1_VISUAL_SETS = {"r1_infoseek": "infoseek_val.jsonl", "r1_dynvqa": "DynVQA_en.202412.jsonl",
                  "r1_webqa": "webqa_val.jsonl"}

# --------------------------------------------------------------------------------------------------
# Reading: JSON lists, JSON objects and JSONL, every row with a `where` for its errors

def _get(row, key, typ, where):
    value = row.get(key) if isinstance(row, dict) else None
    if not isinstance(value, typ):
        raise DataError(
            f"{where}: field '{key}' should be "
            f"{typ.__name__ if isinstance(typ, type) else ' or '.join(t.__name__ for t in typ)}, "
            f"got {type(value).__name__}")
    return value

def _answers(a, where):
    """A str or a list of str -> [answer, *aliases], stripped, distinct, non-empty."""
    out = [x.strip() for x in ([a] if isinstance(a, str) else a if isinstance(a, list) else [None])
           if isinstance(x, str)]
    out = list(dict.fromkeys(x for x in out if x))
    if not out:
        raise DataError(f"{where}: no usable answer in {a!r}")
    return out

def read_json(path):
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: file not found")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise DataError(f"{path}:{e.lineno}: not valid JSON ({json_error(e)})") from None

def rows_of(path):
    """(where, row) of a JSON list of objects or of a JSONL file, whichever `path` holds."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: file not found")
    with open(path, encoding="utf-8") as f:
        first = f.read(4096).lstrip()[:1]
    if first != "[":
        yield from ((f"{path}:{n}", row) for n, row in iter_jsonl(path))
        return
    for i, row in enumerate(read_json(path), 1):
        if not isinstance(row, dict):
            raise DataError(f"{path}: item {i}: expected a JSON object, got {type(row).__name__}")
        yield f"{path}: item {i}", row

def records(data, path):
    """(key, row) of a list of objects or of pandas' to_json column layout {column: {key:
    value}}."""
    if isinstance(data, list):
        return [(str(i), r) for i, r in enumerate(data)]
    if isinstance(data, dict) and data and all(isinstance(c, dict) for c in data.values()):
        keys = list(next(iter(data.values())))
        return [(k, {col: data[col].get(k) for col in data}) for k in keys]
    raise DataError(f"{path}: expected a JSON list of objects or pandas' column layout "
                    f"{{column: {{key: value}}}}")

def _sentences(sents, where):
    """HotpotQA's sentences carry their leading space, 2WikiMultihopQA's do not: join so both read
    as prose."""
    if not isinstance(sents, list) or not all(isinstance(s, str) for s in sents):
        raise DataError(f"{where}: a paragraph's sentences should be a list of strings")
    return "".join(s if i == 0 or s[:1].isspace() else " " + s for i, s in enumerate(sents)).strip()

def read_table(path, tid, title, **dialect):
    """One csv (first row = header) as a table doc; cells' whitespace runs become one space."""
    if not path.is_file():
        raise DataError(f"{path}: file not found")
    with open(path, encoding="utf-8", newline="") as f:
        reader = csv.reader(f, **dialect)
        try:
            rows = [[" ".join(c.split()) for c in r] for r in reader]
        except csv.Error as e:
            raise DataError(f"{path}:{reader.line_num}: {e}") from None
    return table_doc(rows, tid, title, str(path))

def table_doc(rows, tid, title, where):
    if not rows:
        raise DataError(f"{where}: empty table")
    for r in rows[1:]:
        if len(r) != len(rows[0]):
            raise DataError(f"{where}: a row has {len(r)} cells, the header {len(rows[0])}: "
                            f"{r[:3]}")
    t = dict(id=tid, title=title, header=rows[0], rows=rows[1:MAX_ROWS + 1])
    cut = len(rows) - 1 - MAX_ROWS
    t["text"] = linearise(t) + (f" ; ... ({cut} more rows not shown)" if cut > 0 else "")
    return t

# --------------------------------------------------------------------------------------------------
# The data folder being built: KB documents, question splits, corpora to stream; written all at once

class Sink:
    def __init__(self):
        self.docs = {kb: {} for kb in KBS}
        self.splits, self.sources, self.corpora = {}, {}, []

    def paragraph(self, title, body, where):
        """A text-KB paragraph, deduplicated on (title, text); its id is a hash, so it never
        moves."""
        pid = "text-" + hashlib.sha1(f"{title}\n{body}".encode()).hexdigest()[:12]
        if self.docs["text"].setdefault(pid, dict(id=pid, title=title, text=body))["text"] != body:
            raise DataError(f"{where}: id collision on {pid}")
        return pid

    def table(self, t):
        if self.docs["table"].setdefault(t["id"], t) != t:
            raise DataError(f"two different tables have the id {t['id']}")
        return t["id"]

    def add(self, split, rows, source):
        if split in self.splits:
            raise DataError(f"{source}: split {split!r} is given twice (name them: --flag "
                            "NAME=PATH)")
        self.splits[split], self.sources[split] = rows, str(source)

    def write(self, out):
        """Build the folder aside, validate every row and every cited doc id, then swap it in.
        Returns counts."""
        out = Path(out)
        tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            (tmp / "kb").mkdir(parents=True)
            (tmp / "questions").mkdir()
            counts, ids = {}, set()
            for kb in KBS:  # corpora first, streamed: a Wikipedia dump never sits in memory
                streamed = ((f"{p}:{n}", d) for k, p in self.corpora if k == kb
                            for n, d in corpus_rows(p, kb))
                own = ((f"kb/{kb}.jsonl id {d['id']!r}", d) for d in self.docs[kb].values())
                counts[kb] = write_docs(tmp / "kb" / f"{kb}.jsonl", kb,
                                        itertools.chain(streamed, own), ids)
            for split, rows in self.splits.items():
                check_split(split, rows, ids, self.sources[split])
                with open(tmp / "questions" / f"{split}.jsonl", "w", encoding="utf-8") as f:
                    f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
                counts[split] = len(rows)
            (tmp / "import.json").write_text(json.dumps(dict(questions=self.sources, corpora=[
                dict(kb=kb, path=str(Path(p).resolve())) for kb, p in self.corpora],
                counts=counts), indent=1))
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
        return counts

def write_docs(path, kb, items, ids):
    """Write (where, doc) items as one KB file, each checked against the schema and for a unique id;
    returns how many."""
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for where, d in items:
            check_row(d, kb, where)
            if d["id"] in ids:
                raise DataError(f"{where}: duplicate document id {d['id']!r}")
            ids.add(d["id"])
            f.write(json.dumps(d, ensure_ascii=False) + "\n")
            n += 1
    return n

def check_split(split, rows, ids, source):
    seen = set()
    for r in rows:
        where = f"{source} -> questions/{split}.jsonl id {r.get('id')!r}"
        check_row(r, "question", where)
        if r["id"] in seen:
            raise DataError(f"{where}: duplicate question id")
        seen.add(r["id"])
        for s in r["steps"]:
            if s["doc_id"] not in ids:
                raise DataError(f"{where}: cites unknown doc_id {s['doc_id']!r}")

def corpus_rows(path, kb):
    """A JSONL corpus as KB docs: {id, title, text} or {id, contents: 'title\\ntext'} (FlashRAG;
    Search-R1 quotes the title); a table passage keeps its text, with no header or rows; an image
    passage needs `path`; a KB's other fields (dataio.KB_TABLE) are the row's."""
    for n, r in iter_jsonl(path):
        where = f"{path}:{n}"
        did = r.get("id")
        if not isinstance(did, (str, int)):
            raise DataError(f"{where}: field 'id' should be str or int, got {type(did).__name__}")
        if "contents" in r:
            title, _, text = _get(r, "contents", str, where).partition("\n")
            title = title[1:-1] if len(title) > 1 and title[0] == title[-1] == '"' else title
        else:
            title, text = _get(r, "title", str, where), _get(r, "text", str, where)
        doc = dict(id=str(did), title=title, text=text)
        if kb == "table":
            doc = dict(doc, header=r.get("header") or [], rows=r.get("rows") or [])
        if kb == "image":
            pic = Path(path).parent / _get(r, "path", str, where)  # relative to the corpus file
            if not pic.is_file():
                raise DataError(f"{where}: picture not found: {pic}")
            doc = dict(id=doc["id"], title=title, caption=r.get("caption", text),
                       path=str(pic.resolve()))
        # the KB's own fields (a new row of dataio.KB_TABLE), read from the row as its type says
        doc.update({f: _get(r, f, typ, where)
                    for f, typ in KB_OF[kb].fields.items() if f not in doc})
        yield n, doc

# --------------------------------------------------------------------------------------------------
# Multi-hop text QA: HotpotQA and 2WikiMultihopQA (official, FlashRAG, IRCoT), MuSiQue (official,
# FlashRAG)

def multihop_fields(r, where):
    """One HotpotQA / 2WikiMultihopQA row in any of its forms -> (id, question, answers, type,
    paragraphs [(title, text)], supporting titles in order, evidence triples or None)."""
    if "contexts" in r:  # IRCoT: paragraphs flagged is_supporting, answers as spans
        paras = [(_get(c, "title", str, where), _get(c, "paragraph_text", str, where),
                  c.get("is_supporting"))
                 for c in _get(r, "contexts", list, where)]
        spans = [a for o in _get(r, "answers_objects", list, where)
                 for a in _get(o, "spans", list, where)]
        return (_get(r, "question_id", str, where), _get(r, "question_text", str, where), spans,
                r.get("type"),
                [(t, x) for t, x, _ in paras], [t for t, _, sup in paras if sup], None)
    if "metadata" in r:  # FlashRAG: the HF datasets layout, columns of lists, under metadata
        m = _get(r, "metadata", dict, where)
        ctx, sf = (_get(m, "context", dict, f"{where} metadata"),
                   _get(m, "supporting_facts", dict, f"{where} metadata"))
        titles = _get(ctx, "title", list, f"{where} metadata.context")
        sents = ctx.get("sentences", ctx.get("content"))
        if not isinstance(sents, list) or len(sents) != len(titles):
            raise DataError(f"{where}: metadata.context should hold 'title' and 'sentences' (or "
                            "'content') lists of one length")
        paras = [(t, _sentences(s, f"{where} metadata.context")) for t, s in zip(titles, sents)]
        return (str(r.get("id", "")), _get(r, "question", str, where),
                _get(r, "golden_answers", list, where), m.get("type"), paras,
                _get(sf, "title", list, f"{where} metadata.supporting_facts"), m.get("evidences"))
    # official: context [[title, [sentence, ...]], ...], supporting_facts [[title, sent_id], ...]
    if "context" in r:
        paras = []
        for c in _get(r, "context", list, where):
            if not (isinstance(c, list) and len(c) == 2 and isinstance(c[0], str)):
                raise DataError(f"{where}: each context item should be [title, [sentences]]")
            paras.append((c[0], _sentences(c[1], where)))
        sup = [f[0] for f in _get(r, "supporting_facts", list, where) if isinstance(f, list) and f]
        return (str(r.get("_id", r.get("id", ""))), _get(r, "question", str, where),
                _get(r, "answer", str, where), r.get("type"), paras, sup, r.get("evidences"))
    raise DataError(f"{where}: not a HotpotQA / 2WikiMultihopQA row: expected 'context' "
                    f"(official), 'metadata' (FlashRAG) or 'contexts' (IRCoT)")

def _norm_title(t):
    # "Polish-Russian War (film)" -> "polish-russian war"
    return re.sub(r"\s*\(.*?\)\s*", " ", t).strip().lower()

def about(subject, support, k):
    """The supporting paragraph (title, id, text) an evidence triple's subject is about: its title,
    the title without a parenthesised qualifier, a title containing it, a text mentioning it, else
    the k-th supporting paragraph."""
    s = _norm_title(subject)
    for test in (lambda t, x: t == subject, lambda t, x: _norm_title(t) == s,
                 lambda t, x: s and (s in _norm_title(t) or _norm_title(t) in s),
                 lambda t, x: subject in x):
        for t, pid, x in support:
            if test(t, x):
                return pid
    return support[min(k, len(support) - 1)][1]

def read_multihop(path, sink, fmt, limit=None):
    """HotpotQA (fmt "hotpotqa") or 2WikiMultihopQA ("2wiki"): every paragraph to the text KB; gold
    steps from the evidence triples when the row has them, else one unordered step per supporting
    paragraph."""
    rows = []
    for where, r in rows_of(path):
        if limit is not None and len(rows) == limit:
            break
        qid, question, answers, qtype, paras, sup_titles, evidences = multihop_fields(r, where)
        ids = {t: sink.paragraph(t, x, where) for t, x in paras}  # all of them go to the KB
        # title -> its first supporting fact
        order = {t: k for k, t in reversed(list(enumerate(sup_titles)))}
        support = sorted(((t, ids[t], x) for t, x in paras if t in order),
                         key=lambda p: order[p[0]])
        if not support:
            raise DataError(f"{where}: no supporting paragraph among the context ({sup_titles[:3]} "
                            "not found)")
        if evidences:
            steps = []
            for k, ev in enumerate(evidences):
                if not (isinstance(ev, list) and len(ev) == 3
                        and all(isinstance(x, str) for x in ev)):
                    raise DataError(f"{where}: evidences[{k}] should be [subject, relation, "
                                    f"object], got {ev!r}")
                steps.append(dict(sub_question=f"What is the {ev[1]} of {ev[0]}?", kb="text",
                                  doc_id=about(ev[0], support, k), answer=ev[2]))
        else:
            steps = [dict(sub_question="", kb="text", doc_id=pid, answer="")
                     for _, pid, _ in support]
        rows.append(dict(id=qid or f"{fmt}-{len(rows)}", question=question,
                         answers=_answers(answers, where),
                         type=f"{fmt}-{qtype}" if qtype else fmt,
                         pattern=">".join(["text"] * len(steps)), steps=steps))
    return rows

def read_musique(path, sink, limit=None):
    """MuSiQue official ({paragraphs, question_decomposition}) or FlashRAG ({metadata:
    {question_decomposition: [{support_paragraph}]}}): the decomposition's steps, "#k" replaced by
    step k's answer so each stands alone."""
    rows = []
    for where, r in rows_of(path):
        if limit is not None and len(rows) == limit:
            break
        m = r.get("metadata") if isinstance(r.get("metadata"), dict) else r
        if m.get("answerable") is False:
            continue
        if "paragraphs" in r:
            paras = {p.get("idx"): sink.paragraph(_get(p, "title", str, where),
                                                  _get(p, "paragraph_text", str, where), where)
                     for p in _get(r, "paragraphs", list, where)}
        steps = []
        for d in _get(m, "question_decomposition", list, where):
            def ref(match):
                k = int(match.group(1))
                if not 1 <= k <= len(steps):
                    raise DataError(f"{where}: sub-question {d.get('question')!r} refers to #{k}, "
                                    "which is not an earlier step")
                return steps[k - 1]["answer"]
            if "paragraphs" in r:
                if d.get("paragraph_support_idx") not in paras:
                    raise DataError(f"{where}: paragraph_support_idx "
                                    f"{d.get('paragraph_support_idx')!r} is not a paragraph idx")
                pid = paras[d["paragraph_support_idx"]]
            else:
                p = _get(d, "support_paragraph", dict, where)
                pid = sink.paragraph(_get(p, "title", str, where),
                                     _get(p, "paragraph_text", str, where), where)
            steps.append(dict(sub_question=re.sub(r"#(\d+)", ref, _get(d, "question", str, where)),
                              kb="text",
                              doc_id=pid, answer=_get(d, "answer", str, where)))
        answers = (r["golden_answers"] if "golden_answers" in r
                   else [r.get("answer"), *(r.get("answer_aliases") or [])])
        rows.append(dict(id=str(r.get("id", f"musique-{len(rows)}")),
                         question=_get(r, "question", str, where),
                         answers=_answers(answers, where), type=f"musique-{len(steps)}hop",
                         pattern=">".join(["text"] * len(steps)), steps=steps))
    return rows

def read_questions(path, name, limit=None):
    """Questions and answers only ({question, golden_answers | answers | answer}, FlashRAG's and
    R1-Router's sets)."""
    rows = []
    for where, r in rows_of(path):
        if limit is not None and len(rows) == limit:
            break
        answers = next((r[k] for k in ("golden_answers", "answers", "answer") if k in r), None)
        rows.append(dict(id=str(r.get("id", f"{name}-{len(rows)}")),
                         question=_get(r, "question", str, where),
                         answers=_answers(answers, where), type=name, pattern="unknown", steps=[]))
    return rows

# --------------------------------------------------------------------------------------------------
# Tables: WikiTableQuestions, TabFact, Open-WikiTable

def _wtq_unescape(s):  # README_dataset.md: newline -> \n, backslash -> \\, pipe -> \p
    return re.sub(r"\\([np\\])", lambda m: {"n": "\n", "p": "|", "\\": "\\"}[m.group(1)], s)

def read_wtq(path, sink, limit=None):
    """A WikiTableQuestions tsv; each table it cites (csv/203-csv/733.csv, next to the tsv or one
    folder up, as in the release's data/ folder) -> table KB id "wtq-203-733"; a |-separated target
    is one answer, joined with ", "."""
    path = Path(path)
    lines = path.read_text(encoding="utf-8").split("\n") if path.is_file() else None
    if not lines or lines[0].split("\t") != ["id", "utterance", "context", "targetValue"]:
        raise DataError(f"{path}:1: expected a tsv with the header id, utterance, context, "
                        "targetValue")
    root = path.parent if (path.parent / "csv").is_dir() else path.parent.parent
    rows, tables = [], {}
    for n, line in enumerate(lines[1:], 2):
        if not line or (limit is not None and len(rows) == limit):
            continue
        if len(f := line.split("\t")) != 4:
            raise DataError(f"{path}:{n}: expected 4 tab-separated fields, got {len(f)}")
        if f[2] not in tables:  # csv: \" and \\ escaped, newlines inside quotes
            # csv/203-csv/733.csv -> 203-733
            name = "-".join(Path(f[2]).with_suffix("").parts[-2:]).replace("-csv", "")
            tables[f[2]] = sink.table(read_table(root / f[2], f"wtq-{name}",
                                                 f"Wikipedia table {name}",
                                                 escapechar="\\", doublequote=False))
        # several values are one answer: the list
        answer = ", ".join(_wtq_unescape(v) for v in f[3].split("|"))
        question = _wtq_unescape(f[1])
        rows.append(dict(id=f[0], question=question, answers=_answers(answer, f"{path}:{n}"),
                         type="wtq", pattern="table",
                         steps=[dict(sub_question=question, kb="table", doc_id=tables[f[2]],
                                     answer=answer)]))
    return rows

def read_tabfact(path, tables_dir, sink, limit=None):
    """TabFact {"<table>.html.csv": [statements, labels, caption]} + its '#'-separated csv folder:
    each statement becomes "Is it true that <statement>?", answered yes (label 1) or no (0), from
    one table step."""
    if tables_dir is None:
        raise DataError(f"{path}: --tabfact needs --tabfact_tables, the folder of its csv tables "
                        "(all_csv)")
    data, rows = read_json(path), []
    if not isinstance(data, dict):
        raise DataError(f"{path}: expected a JSON object {{table file: [statements, labels, "
                        "caption]}")
    for name, v in data.items():
        where = f"{path}: key {name!r}"
        if not (isinstance(v, list) and len(v) >= 2 and isinstance(v[0], list)
                and isinstance(v[1], list) and len(v[0]) == len(v[1])):
            raise DataError(f"{where}: expected [statements, labels, caption] with one label a "
                            "statement")
        stem = name.removesuffix(".csv").removesuffix(".html")
        tid = sink.table(read_table(Path(tables_dir) / name, f"tabfact-{stem}",
                                    v[2] if len(v) > 2 and isinstance(v[2], str) and v[2] else stem,
                                    delimiter="#", quoting=csv.QUOTE_NONE))
        for k, (statement, label) in enumerate(zip(*v[:2])):
            if limit is not None and len(rows) == limit:
                return rows
            if not isinstance(statement, str) or label not in (0, 1):
                raise DataError(f"{where}: statement {k} should be a string labelled 0 or 1, got "
                                f"{statement!r}, {label!r}")
            q, a = f"Is it true that {statement.strip().rstrip('.')}?", "yes" if label else "no"
            rows.append(dict(id=f"tabfact-{stem}-{k}", question=q, answers=[a], type="tabfact",
                             pattern="table",
                             steps=[dict(sub_question=q, kb="table", doc_id=tid, answer=a)]))
    return rows

def read_openwikitable(path, tables_path, sink, limit=None):
    """Open-WikiTable questions + splitted_tables.json (both pandas JSON or lists of records): every
    table chunk -> table KB id "owt-<key>"; a question's gold step is its first hard-positive chunk
    (else first positive)."""
    if tables_path is None:
        raise DataError(f"{path}: --openwikitable needs --openwikitable_tables "
                        "(splitted_tables.json)")
    for key, t in records(read_json(tables_path), tables_path):
        where = f"{tables_path}: table {key}"
        title = " - ".join(x for x in (t.get("page_title"), t.get("section_title"),
                                       t.get("caption")) if isinstance(x, str) and x)
        header, body = _get(t, "header", list, where), _get(t, "rows", list, where)
        sink.table(table_doc([[str(c) for c in header]] + [[str(c) for c in r] for r in body],
                             f"owt-{key}", title or f"table {key}", where))
    rows = []
    for key, q in records(read_json(path), path):
        if limit is not None and len(rows) == limit:
            break
        where = f"{path}: question {key}"
        answer = ", ".join(str(a) for a in _get(q, "answer", list, where))
        gold = (q.get("hard_positive_idx") or []) + (q.get("positive_idx") or [])
        if gold and f"owt-{gold[0]}" not in sink.docs["table"]:
            raise DataError(f"{where}: positive table {gold[0]!r} is not a key of {tables_path}")
        question = _get(q, "question", str, where)
        rows.append(dict(id=str(q.get("question_id", key)), question=question,
                         answers=_answers(answer, where),
                         type="openwikitable", pattern="table" if gold else "unknown",
                         steps=[dict(sub_question=question, kb="table", doc_id=f"owt-{gold[0]}",
                                     answer=answer)] if gold else []))
    return rows

# --------------------------------------------------------------------------------------------------
# R1-Router's released question sets (questions and answers only; the visual ones given their
# pictures)

def _r1_visual_answers(name, r, where):
    """A visual set's answer list for _answers(): InfoSeek's answer + answer_eval (its numeric
    {wikidata, range} entries have no string and drop out), Dyn-VQA's answers (its few numbers as
    text), WebQA's answer without its quotes."""
    a = _get(r, "answer", list, where)
    if name == "r1_infoseek":
        return a + _get(r, "answer_eval", list, where)
    if name == "r1_dynvqa":
        return [str(x) if isinstance(x, int) else x for x in a]
    # '"..."' -> ...
    return [x[1:-1] if isinstance(x, str) and len(x) > 1 and x[0] == x[-1] == '"' else x
            for x in a]

def _r1_image(folder, r, where):
    """The absolute path of a visual question's picture: <image_id>.jpg (.jpeg, .png, .webp) in
    `folder`."""
    image_id = r.get("image_id")
    if not isinstance(image_id, (str, int)):
        raise DataError(f"{where}: field 'image_id' should be str or int, got "
                        f"{type(image_id).__name__}")
    for ext in IMAGE_EXTS:
        if (folder / f"{image_id}{ext}").is_file():
            return str(folder / f"{image_id}{ext}")
    raise DataError(f"{where}: image {image_id} not found in {folder} (looked for "
                    f"{image_id}{IMAGE_EXTS[0]}, {', '.join(IMAGE_EXTS[1:])})")

def read_r1router(folder, images=None, limit=None):
    """{split: rows} of R1-Router's released sets in `folder`: 2WikiMQA, Open-WikiTable and TabFact
    (pattern "unknown": their gold routes are not released), and each visual set whose picture
    folder `images` names (the others skipped)."""
    folder, images, splits = Path(folder), images or {}, {}
    for name, file in R1_SETS.items():
        splits[name] = read_questions(folder / file, name, limit)
        for k, r in enumerate(splits[name]):
            r["id"] = f"{name}-{k}"  # the sets have no ids
    for name, file in R1_VISUAL_SETS.items():
        if not images.get(name):
            continue
        pics = Path(images[name]).resolve()
        if not pics.is_dir():
            raise DataError(f"{pics}: folder of {name} pictures not found")
        rows = []
        for where, r in rows_of(folder / file):
            if limit is not None and len(rows) == limit:
                break
            rows.append(dict(id=f"{name}-{len(rows)}", question=_get(r, "question", str, where),
                             answers=_answers(_r1_visual_answers(name, r, where), where),
                             type=name, pattern="unknown",
                             steps=[], image=_r1_image(pics, r, where)))
        splits[name] = rows
    return splits

# --------------------------------------------------------------------------------------------------
# --bundle: the folder the development data is kept in, with fixed splits (what `make real` reads)

WTQ_N = 300  # WikiTableQuestions questions per split (train and test drawn disjointly, seed 0)
R1_N = 500   # questions per R1-Router set

def import_bundle(src, out, images=None):
    """src/hotpotqa/dev_distractor_500.jsonl (IRCoT's 500) -> hotpotqa; src/musique/dev_200.jsonl ->
    musique_train, musique (first / last half); src/wikitablequestions/pristine-unseen-tables.tsv ->
    wtq_train, wtq (300 + 300 drawn with seed 0, disjoint); src/r1router/ -> the first 500 of each
    R1-Router set (visual ones given `images`)."""
    src, sink = Path(src), Sink()
    path = src / "hotpotqa" / "dev_distractor_500.jsonl"
    sink.add("hotpotqa", read_multihop(path, sink, "hotpotqa"), path)
    path = src / "musique" / "dev_200.jsonl"
    rows = read_musique(path, sink)
    sink.add("musique_train", rows[:len(rows) // 2], path)
    sink.add("musique", rows[len(rows) // 2:], path)
    path = src / "wikitablequestions" / "pristine-unseen-tables.tsv"
    rows = read_wtq(path, sink)
    rows, k = random.Random(0).sample(rows, len(rows)), min(WTQ_N, len(rows) // 2)
    sink.add("wtq_train", rows[k:2 * k], path)
    sink.add("wtq", rows[:k], path)
    for name, rows in read_r1router(src / "r1router", images, R1_N).items():
        sink.add(name, rows, src / "r1router")
    return sink.write(out)

def split_arg(arg, default):
    """'[SPLIT=]PATH' -> (split, path)."""
    m = re.fullmatch(r"([A-Za-z0-9_.-]+)=(.+)", arg)
    return (m[1], m[2]) if m and not Path(arg).exists() else (default, arg)

def import_files(args):
    """Every format flag of the command line into one Sink, then one data folder."""
    sink = Sink()
    readers = dict(hotpotqa=lambda p: read_multihop(p, sink, "hotpotqa", args.limit),
                   twowiki=lambda p: read_multihop(p, sink, "2wiki", args.limit),
                   musique=lambda p: read_musique(p, sink, args.limit),
                   wtq=lambda p: read_wtq(p, sink, args.limit),
                   tabfact=lambda p: read_tabfact(p, args.tabfact_tables, sink, args.limit),
                   openwikitable=lambda p: read_openwikitable(p, args.openwikitable_tables, sink,
                                                              args.limit))
    for fmt, read in readers.items():
        for arg in getattr(args, fmt):
            split, path = split_arg(arg, "2wiki" if fmt == "twowiki" else fmt)
            sink.add(split, read(path), path)
    for arg in args.questions:
        # bamboogle/test.jsonl -> bamboogle_test
        split, path = split_arg(arg, "_".join(Path(arg).with_suffix("").parts[-2:]))
        sink.add(split, read_questions(path, split, args.limit), path)
    if args.r1router:
        images = dict(r1_infoseek=args.infoseek_images, r1_dynvqa=args.dynvqa_images,
                      r1_webqa=args.webqa_images)
        for name, rows in read_r1router(args.r1router, images, args.limit).items():
            sink.add(name, rows, args.r1router)
    for arg in args.corpus:
        kb, _, path = arg.partition("=")
        if kb not in KBS or not path:
            raise DataError(f"--corpus {arg}: expected KB=PATH with KB one of {', '.join(KBS)}")
        sink.corpora.append((kb, path))
    if not sink.splits and not sink.corpora:
        raise DataError("nothing to import: give --hotpotqa, --twowiki, --musique, --questions, "
                        "--wtq, --tabfact, --openwikitable, --r1router, --corpus or --bundle")
    return sink.write(args.out)

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="the data folder to write (replaced as a whole)")
    for fmt in ("hotpotqa", "twowiki", "musique", "questions", "wtq", "tabfact", "openwikitable"):
        ap.add_argument(f"--{fmt}", action="append", default=[], metavar="[SPLIT=]PATH",
                        help="see above; repeatable")
    ap.add_argument("--tabfact_tables", metavar="DIR",
                    help="TabFact's folder of '#'-separated csv tables (all_csv)")
    ap.add_argument("--openwikitable_tables", metavar="PATH",
                    help="Open-WikiTable's splitted_tables.json")
    ap.add_argument("--r1router", metavar="DIR",
                    help="the folder of R1-Router's released question sets")
    ap.add_argument("--infoseek_images", metavar="DIR",
                    help="with --r1router or --bundle: InfoSeek's pictures (<image_id>.jpg, ...)")
    ap.add_argument("--dynvqa_images", metavar="DIR",
                    help="with --r1router or --bundle: Dyn-VQA's pictures")
    ap.add_argument("--webqa_images", metavar="DIR",
                    help="with --r1router or --bundle: WebQA's pictures")
    ap.add_argument("--corpus", action="append", default=[], metavar="KB=PATH",
                    help="a JSONL corpus streamed into KB; repeatable")
    ap.add_argument("--limit", type=int, default=None,
                    help="the first N questions of each question file")
    ap.add_argument("--bundle", metavar="SRC",
                    help="instead: the development-data folder (import_bundle)")
    args = ap.parse_args()
    formats = ("hotpotqa", "twowiki", "musique", "questions", "wtq", "tabfact", "openwikitable",
               "r1router", "corpus")
    try:
        if args.bundle and any(getattr(args, f) for f in formats):
            raise DataError("--bundle imports a whole folder on its own: give it without the "
                            "format flags")
        if args.bundle:
            counts = import_bundle(args.bundle, args.out, images=dict(
                r1_infoseek=args.infoseek_images, r1_dynvqa=args.dynvqa_images,
                r1_webqa=args.webqa_images))
        else:
            counts = import_files(args)
    except DataError as e:
        sys.exit(f"error: {e}")
    print(f"wrote {args.out}: " + ", ".join(f"{counts[kb]} {kb} docs" for kb in KBS) + "; "
          + ", ".join(f"{n} {k} questions" for k, n in counts.items() if k not in KBS))
