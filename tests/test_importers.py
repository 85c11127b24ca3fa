"""importers.py, one fixture per public format written here (never rows of the real data): the exact converted rows,
one text paragraph for the same passage in every form, 2WikiMultihopQA's evidence triples as gold steps, TabFact's
statements as yes/no questions, Open-WikiTable's chunks, JSONL corpora streamed into a KB, several formats merged into
one folder by one command, and a one-line error naming the file, line or key for each format's broken input."""
import json
import subprocess
import sys
from pathlib import Path

import corpus
import importers
from dataio import load_kb, load_questions
from importers import Sink

ROOT = Path(__file__).resolve().parents[1]
TOWER = ("Ashby Tower", ["Ashby Tower is a lighthouse.", " It was built in 1871 by Mara Quell."])  # HotpotQA: leading spaces
QUELL = ("Mara Quell", ["Mara Quell (1840-1901) was an engineer.", "She was born in Lowmere."])  # 2Wiki: none
NOISE = ("Noise", ["Unrelated text."])

def jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path

def dump(path, data):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))
    return path

def run(*args, cwd):
    return subprocess.run([sys.executable, str(ROOT / "importers.py"), *map(str, args)], capture_output=True, text=True, cwd=cwd)

def one_line_error(r, expected_end):
    assert r.returncode == 1 and r.stderr.startswith("error: ") and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.rstrip("\n").endswith(expected_end), r.stderr

def hotpot_official(tmp_path):
    return dump(tmp_path / "hotpot_dev_distractor_v1.json", [dict(
        _id="5a8b", question="Where was the builder of Ashby Tower born?", answer="Lowmere", type="bridge", level="hard",
        supporting_facts=[["Mara Quell", 1], ["Ashby Tower", 1]], context=[list(TOWER), list(NOISE), list(QUELL)])])

def test_hotpotqa_in_its_three_forms(tmp_path):
    official = hotpot_official(tmp_path)
    flashrag = jsonl(tmp_path / "flashrag" / "dev.jsonl", [dict(
        id="5a8b", question="Where was the builder of Ashby Tower born?", golden_answers=["Lowmere"],
        metadata=dict(type="bridge", level="hard", supporting_facts=dict(title=["Mara Quell", "Ashby Tower"], sent_id=[1, 1]),
                      context=dict(title=[TOWER[0], NOISE[0], QUELL[0]], sentences=[TOWER[1], NOISE[1], QUELL[1]])))])
    ircot = jsonl(tmp_path / "ircot.jsonl", [dict(
        question_id="5a8b", question_text="Where was the builder of Ashby Tower born?",
        answers_objects=[dict(spans=["Lowmere"])], contexts=[
            dict(id="0", title="Ashby Tower", paragraph_text="Ashby Tower is a lighthouse. It was built in 1871 by Mara Quell.",
                 is_supporting=True),
            dict(id="1", title="Mara Quell", paragraph_text="Mara Quell (1840-1901) was an engineer. She was born in Lowmere.",
                 is_supporting=True)])])
    sink = Sink()
    rows = {fmt: importers.read_multihop(path, sink, "hotpotqa") for fmt, path in
            (("official", official), ("flashrag", flashrag), ("ircot", ircot))}
    text = {d["title"]: d for d in sink.docs["text"].values()}
    assert [(d["title"], d["text"]) for d in sink.docs["text"].values()] == [  # one paragraph, whatever the form
        ("Ashby Tower", "Ashby Tower is a lighthouse. It was built in 1871 by Mara Quell."), ("Noise", "Unrelated text."),
        ("Mara Quell", "Mara Quell (1840-1901) was an engineer. She was born in Lowmere.")]
    step = lambda title: dict(sub_question="", kb="text", doc_id=text[title]["id"], answer="")
    assert rows["official"] == rows["flashrag"] == [dict(
        id="5a8b", question="Where was the builder of Ashby Tower born?", answers=["Lowmere"], type="hotpotqa-bridge",
        pattern="text>text", steps=[step("Mara Quell"), step("Ashby Tower")])]  # supporting_facts' order
    assert rows["ircot"] == [dict(rows["official"][0], type="hotpotqa", steps=[step("Ashby Tower"), step("Mara Quell")])]

def test_twowiki_evidence_triples_become_gold_steps(tmp_path):
    official = dump(tmp_path / "dev.json", [
        dict(_id="a1", type="compositional", question="Where was the builder of Ashby Tower (lighthouse) born?",
             answer="Lowmere", context=[["Ashby Tower (lighthouse)", TOWER[1]], list(NOISE), list(QUELL)],
             supporting_facts=[["Ashby Tower (lighthouse)", 1], ["Mara Quell", 1]],
             evidences=[["Ashby Tower", "architect", "Mara Quell"], ["Mara Quell", "place of birth", "Lowmere"]]),
        dict(_id="a2", type="comparison", question="Which is older, Noise or Mara Quell?", answer="Mara Quell",
             context=[list(NOISE), list(QUELL)], supporting_facts=[["Noise", 0], ["Mara Quell", 0]],
             evidences=[["Noise", "inception", "1950"], ["Mara Quell", "date of birth", "1840"]])])
    sink = Sink()
    rows = importers.read_multihop(official, sink, "2wiki")
    ids = {d["title"]: d["id"] for d in sink.docs["text"].values()}
    assert rows[0] == dict(id="a1", question="Where was the builder of Ashby Tower (lighthouse) born?", answers=["Lowmere"],
                           type="2wiki-compositional", pattern="text>text", steps=[
        dict(sub_question="What is the architect of Ashby Tower?", kb="text", doc_id=ids["Ashby Tower (lighthouse)"],
             answer="Mara Quell"),  # the subject names the paragraph without its qualifier
        dict(sub_question="What is the place of birth of Mara Quell?", kb="text", doc_id=ids["Mara Quell"], answer="Lowmere")])
    assert [s["doc_id"] for s in rows[1]["steps"]] == [ids["Noise"], ids["Mara Quell"]]
    assert rows[1]["type"] == "2wiki-comparison" and sink.docs["text"][ids["Mara Quell"]]["text"] == \
        "Mara Quell (1840-1901) was an engineer. She was born in Lowmere."  # 2Wiki's sentences joined with a space
    flashrag = jsonl(tmp_path / "2wiki_flashrag.jsonl", [dict(
        id="a2", question="Which is older, Noise or Mara Quell?", golden_answers=["Mara Quell"], metadata=dict(
            type="comparison", context=dict(title=[NOISE[0], QUELL[0]], content=[NOISE[1], QUELL[1]]),
            supporting_facts=dict(title=["Noise", "Mara Quell"], sent_id=[0, 0]),
            evidences=[["Noise", "inception", "1950"], ["Mara Quell", "date of birth", "1840"]]))])
    assert importers.read_multihop(flashrag, sink, "2wiki") == rows[1:]
    # a broken triple: one line naming the file and item
    bad = json.loads(official.read_text())
    bad[1]["evidences"][1] = ["Mara Quell", "date of birth"]
    r = run("--out", "d", "--twowiki", dump(tmp_path / "bad.json", bad), cwd=tmp_path)
    one_line_error(r, "bad.json: item 2: evidences[1] should be [subject, relation, object], got ['Mara Quell', 'date of birth']")
    assert not (tmp_path / "d").exists()

def test_musique_flashrag_form_and_unanswerable_rows(tmp_path):
    sp = lambda title, body: dict(title=title, paragraph_text=body)
    path = jsonl(tmp_path / "musique" / "dev.jsonl", [
        dict(id="2hop__1", question="Where was the builder of Ashby Tower born?", golden_answers=["Lowmere"],
             metadata=dict(answerable=True, question_decomposition=[
                 dict(id=1, question="Ashby Tower >> architect", answer="Mara Quell", paragraph_support_idx=0,
                      support_paragraph=sp("Ashby Tower", "Built by Mara Quell.")),
                 dict(id=2, question="Where was #1 born?", answer="Lowmere", paragraph_support_idx=3,
                      support_paragraph=sp("Mara Quell", "Born in Lowmere."))])),
        dict(id="2hop__2", question="Unanswerable?", golden_answers=["x"], metadata=dict(answerable=False, question_decomposition=[]))])
    sink = Sink()
    ids = lambda: {d["title"]: d["id"] for d in sink.docs["text"].values()}
    rows = importers.read_musique(path, sink)
    assert rows == [dict(id="2hop__1", question="Where was the builder of Ashby Tower born?", answers=["Lowmere"],
                         type="musique-2hop", pattern="text>text", steps=[
        dict(sub_question="Ashby Tower >> architect", kb="text", doc_id=ids()["Ashby Tower"], answer="Mara Quell"),
        dict(sub_question="Where was Mara Quell born?", kb="text", doc_id=ids()["Mara Quell"], answer="Lowmere")])]
    path.write_text(path.read_text().replace('"support_paragraph": {"title": "Mara Quell", ', '"support": {"title": "Mara Quell", '))
    r = run("--out", "d", "--musique", path, cwd=tmp_path)
    one_line_error(r, "dev.jsonl:1: field 'support_paragraph' should be dict, got NoneType")

def test_question_sets_and_corpora_merge_into_one_folder(tmp_path):
    """One command: HotpotQA official, a FlashRAG question set (Bamboogle), a Search-R1 corpus and a {title, text} one."""
    hotpot = hotpot_official(tmp_path)
    jsonl(tmp_path / "bamboogle" / "test.jsonl", [
        dict(id="test_0", question="Who built Ashby Tower?", golden_answers=["Mara Quell", " M. Quell "]),
        dict(question="When?", answers=["1871"])])
    jsonl(tmp_path / "wiki.jsonl", [dict(id="0", contents='"Lowmere"\nLowmere is a town.'),
                                    dict(id=1, contents="Ivo Brandt\nIvo Brandt is the mayor of Lowmere.")])
    jsonl(tmp_path / "tables.jsonl", [dict(id="t0", title="Towers", text="Towers ; name | year ; Ashby Tower | 1871")])
    from PIL import Image
    Image.new("RGB", (4, 4), "white").save(tmp_path / "tower.png")
    jsonl(tmp_path / "pics.jsonl", [dict(id="i0", title="Ashby Tower", text="A white lighthouse.", path="tower.png")])
    r = run("--out", "data/merged", "--hotpotqa", f"hotpot_dev={hotpot}", "--questions", "bamboogle/test.jsonl",
            "--corpus", "text=wiki.jsonl", "--corpus", "table=tables.jsonl", "--corpus", "image=pics.jsonl", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == ("wrote data/merged: 5 text docs, 1 table docs, 1 image docs; "
                                "1 hotpot_dev questions, 2 bamboogle_test questions")
    out = tmp_path / "data" / "merged"
    text = load_kb(out, "text")
    assert [(d["id"], d["title"], d["text"]) for d in text[:2]] == [  # corpora first, their own ids, Search-R1's quotes off
        ("0", "Lowmere", "Lowmere is a town."), ("1", "Ivo Brandt", "Ivo Brandt is the mayor of Lowmere.")]
    assert load_kb(out, "table") == [dict(id="t0", title="Towers", text="Towers ; name | year ; Ashby Tower | 1871",
                                          header=[], rows=[])]
    assert load_kb(out, "image")[0]["path"] == str(tmp_path / "tower.png") and load_kb(out, "image")[0]["caption"] == "A white lighthouse."
    assert load_questions(out, "bamboogle_test") == [
        dict(id="test_0", question="Who built Ashby Tower?", answers=["Mara Quell", "M. Quell"], type="bamboogle_test",
             pattern="unknown", steps=[]),
        dict(id="bamboogle_test-1", question="When?", answers=["1871"], type="bamboogle_test", pattern="unknown", steps=[])]
    assert load_questions(out, "hotpot_dev")[0]["id"] == "5a8b"
    assert corpus.check(out) == dict(text=5, table=1, image=1, hotpot_dev=1, bamboogle_test=2)
    assert json.loads((out / "import.json").read_text())["questions"] == dict(hotpot_dev=str(hotpot), bamboogle_test="bamboogle/test.jsonl")
    # broken input anywhere leaves the previous folder as it was
    jsonl(tmp_path / "wiki.jsonl", [dict(id="0", contents="Lowmere\nA town."), dict(id="0", title="Twice", text="...")])
    r = run("--out", "data/merged", "--hotpotqa", f"hotpot_dev={hotpot}", "--corpus", "text=wiki.jsonl", cwd=tmp_path)
    one_line_error(r, "wiki.jsonl:2: duplicate document id '0'")
    jsonl(tmp_path / "wiki.jsonl", [dict(id="0", text="no title")])
    one_line_error(run("--out", "data/merged", "--corpus", "text=wiki.jsonl", cwd=tmp_path),
                   "wiki.jsonl:1: field 'title' should be str, got NoneType")
    one_line_error(run("--out", "data/merged", "--questions", "q=bamboogle/test.jsonl", "--questions", "q=bamboogle/test.jsonl",
                       cwd=tmp_path), "bamboogle/test.jsonl: split 'q' is given twice (name them: --flag NAME=PATH)")
    jsonl(tmp_path / "noanswer.jsonl", [dict(question="Who?", golden_answers=[])])
    one_line_error(run("--out", "data/merged", "--questions", "noanswer.jsonl", cwd=tmp_path), "noanswer.jsonl:1: no usable answer in []")
    one_line_error(run("--out", "data/merged", "--corpus", "texts=wiki.jsonl", cwd=tmp_path),
                   "--corpus texts=wiki.jsonl: expected KB=PATH with KB one of text, table, image")
    one_line_error(run("--out", "data/merged", cwd=tmp_path), "--corpus or --bundle")
    one_line_error(run("--out", "data/merged", "--hotpotqa", "missing.json", cwd=tmp_path), "missing.json: file not found")
    assert load_questions(out, "bamboogle_test")[0]["id"] == "test_0" and sorted(p.name for p in out.parent.iterdir()) == ["merged"]

def test_wikitablequestions_in_the_release_layout(tmp_path):
    root = tmp_path / "WikiTableQuestions"  # data/*.tsv, csv/ one level up
    (root / "csv" / "204-csv").mkdir(parents=True)
    (root / "csv" / "204-csv" / "5.csv").write_text('"Year","City"\n"1871","Lowmere"\n"1901","Ashby"\n')
    (root / "data").mkdir()
    (root / "data" / "training.tsv").write_text("id\tutterance\tcontext\ttargetValue\n"
                                                "nt-0\twhere in 1871?\tcsv/204-csv/5.csv\tLowmere\n"
                                                "nt-1\twhich years?\tcsv/204-csv/5.csv\t1871|1901\n")
    sink = Sink()
    rows = importers.read_wtq(root / "data" / "training.tsv", sink, limit=5)
    assert [r["answers"] for r in rows] == [["Lowmere"], ["1871, 1901"]] and rows[1]["steps"][0]["doc_id"] == "wtq-204-5"
    assert sink.docs["table"]["wtq-204-5"]["rows"] == [["1871", "Lowmere"], ["1901", "Ashby"]]
    (root / "data" / "training.tsv").write_text("id\tutterance\tcontext\ttargetValue\nnt-0\twhere?\tcsv/204-csv/6.csv\tx\n")
    one_line_error(run("--out", "d", "--wtq", root / "data" / "training.tsv", cwd=tmp_path), "csv/204-csv/6.csv: file not found")

def test_tabfact_statements_become_yes_no_questions(tmp_path):
    tables = tmp_path / "all_csv"
    tables.mkdir()
    (tables / "2-1859269-1.html.csv").write_text('year#city#note\n1871#lowmere#"built"\n1901#ashby#x\n')
    statements = dump(tmp_path / "r2_training_all.json", {"2-1859269-1.html.csv": [
        ["ashby be the city in 1901", "lowmere be the city in 1901."], [1, 0], "towers of arvenia"]})
    r = run("--out", "d", "--tabfact", statements, "--tabfact_tables", tables, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    t = load_kb(tmp_path / "d", "table")[0]
    assert t["id"] == "tabfact-2-1859269-1" and t["title"] == "towers of arvenia"
    assert t["header"] == ["year", "city", "note"] and t["rows"][0] == ["1871", "lowmere", '"built"']  # '#', no quoting
    step = lambda q, a: dict(sub_question=q, kb="table", doc_id="tabfact-2-1859269-1", answer=a)
    q0, q1 = "Is it true that ashby be the city in 1901?", "Is it true that lowmere be the city in 1901?"
    assert load_questions(tmp_path / "d", "tabfact") == [
        dict(id="tabfact-2-1859269-1-0", question=q0, answers=["yes"], type="tabfact", pattern="table", steps=[step(q0, "yes")]),
        dict(id="tabfact-2-1859269-1-1", question=q1, answers=["no"], type="tabfact", pattern="table", steps=[step(q1, "no")])]
    one_line_error(run("--out", "d2", "--tabfact", statements, cwd=tmp_path),
                   "r2_training_all.json: --tabfact needs --tabfact_tables, the folder of its csv tables (all_csv)")
    dump(statements, {"2-1859269-1.html.csv": [["a", "b"], [1, 2], "c"]})
    one_line_error(run("--out", "d2", "--tabfact", statements, "--tabfact_tables", tables, cwd=tmp_path),
                   "r2_training_all.json: key '2-1859269-1.html.csv': statement 1 should be a string labelled 0 or 1, got 'b', 2")
    assert load_questions(tmp_path / "d", "tabfact")[0]["answers"] == ["yes"] and not (tmp_path / "d2").exists()

def test_openwikitable_pandas_layout(tmp_path):
    """Open-WikiTable's files are pandas' to_json: {column: {row key: value}}."""
    tables = dump(tmp_path / "splitted_tables.json", dict(
        page_title={"1": "Arvenia", "2": "Suldor"}, section_title={"1": "Towers", "2": ""}, caption={"1": "", "2": "Mayors"},
        header={"1": ["Tower", "Year"], "2": ["Town", "Mayor"]}, rows={"1": [["Ashby", 1871]], "2": [["Lowmere", "Ivo Brandt"]]}))
    questions = dump(tmp_path / "test.json", dict(
        question_id={"0": "q0", "1": "q1"}, question={"0": "Who is the mayor of Lowmere?", "1": "Which towers?"},
        answer={"0": ["Ivo Brandt"], "1": ["Ashby", "Corven"]}, hard_positive_idx={"0": [2], "1": []},
        positive_idx={"0": [], "1": [1]}, dataset={"0": "wikisql", "1": "wikitq"}))
    sink = Sink()
    rows = importers.read_openwikitable(questions, tables, sink)
    assert sink.docs["table"]["owt-1"] == dict(id="owt-1", title="Arvenia - Towers", header=["Tower", "Year"],
                                               rows=[["Ashby", "1871"]], text="Arvenia - Towers ; Tower | Year ; Ashby | 1871")
    assert rows == [
        dict(id="q0", question="Who is the mayor of Lowmere?", answers=["Ivo Brandt"], type="openwikitable", pattern="table",
             steps=[dict(sub_question="Who is the mayor of Lowmere?", kb="table", doc_id="owt-2", answer="Ivo Brandt")]),
        dict(id="q1", question="Which towers?", answers=["Ashby, Corven"], type="openwikitable", pattern="table",
             steps=[dict(sub_question="Which towers?", kb="table", doc_id="owt-1", answer="Ashby, Corven")])]
    bad = json.loads(questions.read_text())
    bad["hard_positive_idx"]["0"] = [7]
    one_line_error(run("--out", "d", "--openwikitable", dump(tmp_path / "bad.json", bad), "--openwikitable_tables", tables,
                       cwd=tmp_path), "bad.json: question 0: positive table 7 is not a key of " + str(tables))
    dump(tmp_path / "flat.json", {"question": "Who?"})
    one_line_error(run("--out", "d", "--openwikitable", tmp_path / "flat.json", "--openwikitable_tables", tables, cwd=tmp_path),
                   "flat.json: expected a JSON list of objects or pandas' column layout {column: {key: value}}")

def test_bad_rows_name_the_file_and_item(tmp_path):
    dump(tmp_path / "a.json", [dict(_id="x", question="Q?", answer="A", supporting_facts=[["Elsewhere", 0]],
                                    context=[list(NOISE)])])
    one_line_error(run("--out", "d", "--hotpotqa", "a.json", cwd=tmp_path),
                   "a.json: item 1: no supporting paragraph among the context (['Elsewhere'] not found)")
    jsonl(tmp_path / "b.jsonl", [dict(question="Q?", answer="A")])
    one_line_error(run("--out", "d", "--hotpotqa", "b.jsonl", cwd=tmp_path), "b.jsonl:1: not a HotpotQA / 2WikiMultihopQA row: "
                   "expected 'context' (official), 'metadata' (FlashRAG) or 'contexts' (IRCoT)")
    (tmp_path / "c.json").write_text('[{"_id": "x",\n "question": }]')
    one_line_error(run("--out", "d", "--hotpotqa", "c.json", cwd=tmp_path), "c.json:2: not valid JSON (Expecting value at column 14)")
    one_line_error(run("--out", "d", "--bundle", tmp_path, "--hotpotqa", "a.json", cwd=tmp_path),
                   "--bundle imports a whole folder on its own: give it without the format flags")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json", "b.jsonl", "c.json"]
