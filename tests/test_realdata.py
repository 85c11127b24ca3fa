"""importers.py --bundle on tiny fixtures written here in each benchmark's own format (never rows of the real data):
the exact converted rows, ids that resolve in the KBs, "#k" substituted, WTQ unescaping and answer joining, the empty
image KB through retrievers.py, path:line errors on broken input, and R1-Router's visual sets given folders of tiny
pictures (absolute image paths, cleaned answers, a missing picture named)."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import corpus
import dataio
import importers
from dataio import DataError, load_kb, load_questions
from importers import import_bundle

ROOT = Path(__file__).resolve().parents[1]

def jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))

def ctx(i, title, text, sup):
    return dict(id=str(i), title=title, paragraph_text=text, is_supporting=sup)

TOWER = ("Ashby Tower", "Ashby Tower is a lighthouse built in 1871 by Mara Quell.")  # shared by all three sources
QUELL = ("Mara Quell", "Mara Quell (1840-1901) was an engineer born in Lowmere.")
LOWMERE = ("Lowmere", "Lowmere is a town whose mayor is Ivo Brandt.")

def write_fixture(src):
    jsonl(src / "hotpotqa" / "dev_distractor_500.jsonl", [
        dict(question_id="hp1", question_text="Where was the builder of Ashby Tower born?",
             answers_objects=[dict(number="", date=dict(day="", month="", year=""), spans=["Lowmere"])],
             contexts=[ctx(0, *QUELL, True), ctx(1, "Noise", "Unrelated text.", False), ctx(2, *TOWER, True)]),
        dict(question_id="hp2", question_text="Is Ashby Tower older than Lowmere?",
             answers_objects=[dict(number="", date=dict(day="", month="", year=""), spans=["yes", " yes "])],
             contexts=[ctx(0, *TOWER, True), ctx(1, *LOWMERE, True)]),
    ])
    jsonl(src / "musique" / "dev_200.jsonl", [dict(
        id="2hop__1_2", question="Who is the mayor of the birthplace of the builder of Ashby Tower?", answerable=True,
        paragraphs=[dict(idx=0, title=LOWMERE[0], paragraph_text=LOWMERE[1], is_supporting=True),
                    dict(idx=1, title=TOWER[0], paragraph_text=TOWER[1], is_supporting=True),
                    dict(idx=2, title=QUELL[0], paragraph_text=QUELL[1], is_supporting=True)],
        question_decomposition=[dict(id=1, question="Ashby Tower >> builder", answer="Mara Quell", paragraph_support_idx=1),
                                dict(id=2, question="Where was #1 born?", answer="Lowmere", paragraph_support_idx=2),
                                dict(id=3, question="Who is the mayor of #2 (home of #1)?", answer="Ivo Brandt",
                                     paragraph_support_idx=0)],
        answer="Ivo Brandt", answer_aliases=["I. Brandt", "Ivo Brandt"])])
    wtq = src / "wikitablequestions"
    (wtq / "csv" / "200-csv").mkdir(parents=True)
    # csv escaping (README_dataset.md): \" and \\ escaped, newlines inside quotes; whitespace runs become one space
    (wtq / "csv" / "200-csv" / "0.csv").write_text(
        '"Rank","Name","Time\n(s)"\n"1","Ana \\"Red\\" Lo","9.8"\n"2","B\\\\C","10.1"\n', encoding="utf-8")
    (wtq / "csv" / "200-csv" / "0.tsv").write_text('Rank\tName\tTime\\n(s)\n1\tAna "Red" Lo\t9.8\n2\tB\\\\C\t10.1\n')
    (wtq / "csv" / "200-csv" / "1.csv").write_text('"n","sq"\n' + "".join(f'"{i}","{i * i}"\n' for i in range(32)))
    (wtq / "pristine-unseen-tables.tsv").write_text(
        "id\tutterance\tcontext\ttargetValue\n"
        "nu-0\twho ran a\\p b first?\\nname only\tcsv/200-csv/0.csv\tAna \"Red\" Lo\n"
        "nu-1\twhich squares are below 2?\tcsv/200-csv/1.csv\t0|1\n"
        "nu-2\twhat is the time of b\\\\c?\tcsv/200-csv/0.csv\t10.1|x\\py\n")
    jsonl(src / "r1router" / "2wikimultihopqa_val.jsonl", [dict(question="Who is older, A or B?", answer="A")])
    jsonl(src / "r1router" / "openwikitqa_val.jsonl", [dict(question="When?", answer=["2011-12", "", "2011-12", " 2012 "])])
    jsonl(src / "r1router" / "tabfact_val.jsonl", [dict(question="is x 5?", answer="yes"), dict(question="is y 6?", answer="no")])
    # the visual sets: skipped unless given their pictures (PICTURES)
    jsonl(src / "r1router" / "infoseek_val.jsonl", [
        dict(data_id="infoseek_val_00000000", image_id="oven_00000001", question="What is the purpose of this object?",
             answer=["navigation aid"], answer_eval=["light signal", "navigation aid", " beacon "]),
        dict(data_id="infoseek_val_00000001", image_id="oven_00000002", question="How tall is this tower, in metres?",
             answer=["38"], answer_eval=[{"wikidata": 38.0, "range": [34.2, 41.8]}]),
        dict(data_id="infoseek_val_00000002", image_id="oven_00000001", question="Who built this object?",
             answer=["Mara Quell", "M. Quell"], answer_eval=["Mara Quell"])])
    jsonl(src / "r1router" / "DynVQA_en.202412.jsonl", [
        dict(question="Who built this lighthouse?", question_id="en1", answer=["玛拉·奎尔", "Mara Quell"],
             gloden_query="Who built Ashby Tower?", image_id=1),
        dict(question="How many towers did she build?", question_id="en2", answer=[1, "一", "one", 1],
             gloden_query="How many towers did Mara Quell build?", image_id=2)])
    jsonl(src / "r1router" / "webqa_val.jsonl", [
        dict(question="Is Ashby Tower painted white?", answer=['"Ashby Tower is painted white."'], image_id="30000001"),
        dict(question="What is written on the door?", answer=['""Keep out" is written on the door."'], image_id="30000002")])

PICTURES = ("infoseek/oven_00000001.jpg", "infoseek/oven_00000002.png", "dynvqa/1.png", "dynvqa/2.jpeg",
            "webqa/30000001.webp", "webqa/30000002.png")

def write_pictures(folder):
    from PIL import Image
    for name in PICTURES:
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (4, 4), "white").save(folder / name)
    return {f"r1_{kind}": folder / kind for kind in ("infoseek", "dynvqa", "webqa")}

@pytest.fixture(scope="module")
def real(tmp_path_factory):
    src = tmp_path_factory.mktemp("shared") / "data"
    write_fixture(src)
    out = tmp_path_factory.mktemp("repo") / "real"
    counts = import_bundle(src, out)
    return src, out, counts

def test_layout_and_counts(real):
    src, out, counts = real
    assert counts == dict(text=4, table=2, image=0, hotpotqa=2, musique=1, musique_train=0, r1_2wiki=1,
                          r1_openwikitqa=1, r1_tabfact=2, wtq=1, wtq_train=1)
    assert (out / "kb" / "image.jsonl").read_text() == ""
    assert sorted(p.name for p in out.parent.iterdir()) == ["real"]  # no temp folder left
    assert corpus.check(out) == counts

def test_text_kb_is_deduplicated_with_stable_ids(real):
    _, out, _ = real
    docs = {(d["title"], d["text"]): d["id"] for d in load_kb(out, "text")}
    assert set(docs) == {TOWER, QUELL, LOWMERE, ("Noise", "Unrelated text.")}  # TOWER appears 3 times in the sources
    assert all(i.startswith("text-") and len(i) == 17 for i in docs.values())
    again = import_bundle(real[0], out.parent / "again")
    assert again and {(d["title"], d["text"]): d["id"] for d in load_kb(out.parent / "again", "text")} == docs

def test_hotpotqa_rows(real):
    _, out, _ = real
    ids = {d["title"]: d["id"] for d in load_kb(out, "text")}
    step = lambda title: dict(sub_question="", kb="text", doc_id=ids[title], answer="")
    assert load_questions(out, "hotpotqa") == [
        dict(id="hp1", question="Where was the builder of Ashby Tower born?", answers=["Lowmere"], type="hotpotqa",
             pattern="text>text", steps=[step("Mara Quell"), step("Ashby Tower")]),
        dict(id="hp2", question="Is Ashby Tower older than Lowmere?", answers=["yes"], type="hotpotqa",
             pattern="text>text", steps=[step("Ashby Tower"), step("Lowmere")])]

def test_musique_rows_have_self_contained_sub_questions(real):
    _, out, _ = real
    ids = {d["title"]: d["id"] for d in load_kb(out, "text")}
    assert load_questions(out, "musique") == [dict(
        id="2hop__1_2", question="Who is the mayor of the birthplace of the builder of Ashby Tower?",
        answers=["Ivo Brandt", "I. Brandt"], type="musique-3hop", pattern="text>text>text", steps=[
            dict(sub_question="Ashby Tower >> builder", kb="text", doc_id=ids["Ashby Tower"], answer="Mara Quell"),
            dict(sub_question="Where was Mara Quell born?", kb="text", doc_id=ids["Mara Quell"], answer="Lowmere"),
            dict(sub_question="Who is the mayor of Lowmere (home of Mara Quell)?", kb="text", doc_id=ids["Lowmere"],
                 answer="Ivo Brandt")])]
    assert load_questions(out, "musique_train") == []  # the first half of one question

def test_wtq_tables_and_questions(real):
    _, out, _ = real
    t0, t1 = load_kb(out, "table")
    assert t0 == dict(id="wtq-200-0", title="Wikipedia table 200-0", header=["Rank", "Name", "Time (s)"],
                      rows=[["1", 'Ana "Red" Lo', "9.8"], ["2", "B\\C", "10.1"]],
                      text='Wikipedia table 200-0 ; Rank | Name | Time (s) ; 1 | Ana "Red" Lo | 9.8 ; 2 | B\\C | 10.1')
    assert t1["id"] == "wtq-200-1" and len(t1["rows"]) == 30 and t1["rows"][-1] == ["29", "841"]
    assert t1["text"].endswith(" ; 29 | 841 ; ... (2 more rows not shown)")
    expected = {
        "nu-0": dict(id="nu-0", question="who ran a| b first?\nname only", answers=['Ana "Red" Lo'], type="wtq",
                     pattern="table", steps=[dict(sub_question="who ran a| b first?\nname only", kb="table",
                                                  doc_id="wtq-200-0", answer='Ana "Red" Lo')]),
        "nu-1": dict(id="nu-1", question="which squares are below 2?", answers=["0, 1"], type="wtq", pattern="table",
                     steps=[dict(sub_question="which squares are below 2?", kb="table", doc_id="wtq-200-1", answer="0, 1")]),
        "nu-2": dict(id="nu-2", question="what is the time of b\\c?", answers=["10.1, x|y"], type="wtq", pattern="table",
                     steps=[dict(sub_question="what is the time of b\\c?", kb="table", doc_id="wtq-200-0", answer="10.1, x|y")]),
    }
    test, train = load_questions(out, "wtq"), load_questions(out, "wtq_train")
    assert len(test) == len(train) == 1 and test[0]["id"] != train[0]["id"]  # 3 questions: 1 + 1, disjoint
    for row in test + train:
        assert row == expected[row["id"]]

def test_r1router_sets(real):
    _, out, _ = real
    assert load_questions(out, "r1_2wiki") == [dict(id="r1_2wiki-0", question="Who is older, A or B?", answers=["A"],
                                                    type="r1_2wiki", pattern="unknown", steps=[])]
    assert load_questions(out, "r1_openwikitqa")[0]["answers"] == ["2011-12", "2012"]  # list: stripped, distinct
    assert [q["answers"] for q in load_questions(out, "r1_tabfact")] == [["yes"], ["no"]]
    for name in ("r1_infoseek", "r1_dynvqa", "r1_webqa"):  # no picture folders given: skipped
        assert not (out / "questions" / f"{name}.jsonl").exists()

@pytest.fixture(scope="module")
def visual(real, tmp_path_factory):
    images = write_pictures(tmp_path_factory.mktemp("pictures"))
    out = tmp_path_factory.mktemp("repo") / "real"
    return images, out, import_bundle(real[0], out, images=images)

def test_visual_sets(visual, real):
    images, out, counts = visual
    assert counts == dict(real[2], r1_infoseek=3, r1_dynvqa=2, r1_webqa=2)
    assert corpus.check(out) == counts
    pic = lambda kind, name: str(images[f"r1_{kind}"] / name)
    row = lambda name, k, question, answers, image: dict(id=f"{name}-{k}", question=question, answers=answers,
                                                        type=name, pattern="unknown", steps=[], image=image)
    assert load_questions(out, "r1_infoseek") == [  # answer, then answer_eval aliases; numeric ranges drop out
        row("r1_infoseek", 0, "What is the purpose of this object?", ["navigation aid", "light signal", "beacon"],
            pic("infoseek", "oven_00000001.jpg")),
        row("r1_infoseek", 1, "How tall is this tower, in metres?", ["38"], pic("infoseek", "oven_00000002.png")),
        row("r1_infoseek", 2, "Who built this object?", ["Mara Quell", "M. Quell"],
            pic("infoseek", "oven_00000001.jpg"))]  # pictures may be shared
    assert load_questions(out, "r1_dynvqa") == [  # every answer, numbers as text
        row("r1_dynvqa", 0, "Who built this lighthouse?", ["玛拉·奎尔", "Mara Quell"], pic("dynvqa", "1.png")),
        row("r1_dynvqa", 1, "How many towers did she build?", ["1", "一", "one"], pic("dynvqa", "2.jpeg"))]
    assert load_questions(out, "r1_webqa") == [  # the surrounding quotes stripped, inner ones kept
        row("r1_webqa", 0, "Is Ashby Tower painted white?", ["Ashby Tower is painted white."],
            pic("webqa", "30000001.webp")),
        row("r1_webqa", 1, "What is written on the door?", ['"Keep out" is written on the door.'],
            pic("webqa", "30000002.png"))]
    for name in images:  # stored as absolute paths to the user's pictures, not copied into the data folder
        for q in dataio.read_jsonl(out / "questions" / f"{name}.jsonl"):
            assert Path(q["image"]).is_absolute() and Path(q["image"]).is_file()
    assert sorted(p.name for p in out.rglob("*") if p.is_file() and p.suffix != ".jsonl") == ["import.json"]

def test_visual_sets_keep_the_first_rows(visual, real, tmp_path, monkeypatch):
    monkeypatch.setattr(importers, "R1_N", 1)
    counts = import_bundle(real[0], tmp_path / "out", images=visual[0])
    assert counts["r1_infoseek"] == counts["r1_dynvqa"] == counts["r1_webqa"] == 1
    assert load_questions(tmp_path / "out", "r1_webqa")[0]["id"] == "r1_webqa-0"

def test_missing_picture_names_file_line_and_path(visual, real, tmp_path):
    import shutil
    images = {name: tmp_path / "pictures" / name for name in visual[0]}
    for name, folder in visual[0].items():
        shutil.copytree(folder, images[name])
    (images["r1_infoseek"] / "oven_00000002.png").unlink()
    with pytest.raises(DataError) as e:
        import_bundle(real[0], tmp_path / "out", images=images)
    assert str(e.value) == (f"{real[0]}/r1router/infoseek_val.jsonl:2: image oven_00000002 not found in "
                            f"{images['r1_infoseek']} (looked for oven_00000002.jpg, .jpeg, .png, .webp)")
    with pytest.raises(DataError, match=r"/nowhere: folder of r1_dynvqa pictures not found$"):
        import_bundle(real[0], tmp_path / "out", images=dict(r1_dynvqa=tmp_path / "nowhere"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pictures"]  # nothing half-written

def test_cli_prints_the_summary(real, tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "importers.py"), "--bundle", str(real[0]), "--out", str(tmp_path / "r")],
                       capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "4 text docs, 2 table docs, 0 image docs; 2 hotpotqa questions" in r.stdout
    assert not (tmp_path / "data").exists()  # --out honoured

def test_cli_picture_flags(real, tmp_path):
    write_pictures(tmp_path / "pics")
    flags = [a for kind in ("infoseek", "dynvqa", "webqa") for a in (f"--{kind}_images", f"pics/{kind}")]  # relative
    cmd = lambda out: [sys.executable, str(ROOT / "importers.py"), "--bundle", str(real[0]), "--out", out, *flags]
    r = subprocess.run(cmd("r"), capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "3 r1_infoseek questions, 2 r1_dynvqa questions, 2 r1_webqa questions" in r.stdout
    assert load_questions(tmp_path / "r", "r1_dynvqa")[0]["image"] == str(tmp_path / "pics" / "dynvqa" / "1.png")
    (tmp_path / "pics" / "webqa" / "30000001.webp").unlink()
    r = subprocess.run(cmd("r2"), capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 1 and r.stderr.count("\n") == 1
    assert r.stderr.endswith("webqa_val.jsonl:1: image 30000001 not found in "
                             f"{tmp_path / 'pics' / 'webqa'} (looked for 30000001.jpg, .jpeg, .png, .webp)\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pics", "r"]

class HashEncoder:
    """A stand-in for MiniLM (loading it takes seconds): L2-normalised hashed bag of lower-cased words."""
    path, dim = "hash", 64

    def encode(self, texts, progress=False):
        import zlib
        out = np.zeros((len(texts), self.dim), dtype=np.float32)  # [n, dim]
        for i, t in enumerate(texts):
            for w in t.lower().replace("?", " ").replace('"', " ").split():
                out[i, zlib.crc32(w.encode()) % self.dim] += 1
        return out / np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-9)

def test_empty_image_kb_builds_and_searches(real):
    import retrievers
    _, out, _ = real
    meta = retrievers.build(out, methods=("dense", "bm25"), encoder=HashEncoder(), progress=False)
    assert meta["kbs"]["image"] == dict(n=0, first=None, last=None)
    assert not list((out / "index").glob("image.*"))
    r = retrievers.Retriever(out, "hybrid", encoder=HashEncoder())  # dense and bm25 together (fused runs go 4k deep)
    assert r.search(["a lighthouse", "a portrait"], "image", 3) == [[], []]
    assert r.search(["Where was Mara Quell born?"], "text", 1)[0][0]["title"] == "Mara Quell"
    assert sorted(d["id"] for d in r.search(["which squares?"], "table", 5)[0]) == ["wtq-200-0", "wtq-200-1"]  # k > KB

def test_broken_input_names_path_and_line(real, tmp_path):
    import shutil
    src = tmp_path / "data"
    shutil.copytree(real[0], src)
    mus = src / "musique" / "dev_200.jsonl"
    good = mus.read_text()
    mus.write_text(good + '{"id": "broken", \n')
    with pytest.raises(DataError, match=r"musique/dev_200\.jsonl:2: not valid JSON"):
        import_bundle(src, tmp_path / "out")
    mus.write_text(good.replace("Where was #1 born?", "Where was #3 born?"))
    with pytest.raises(DataError, match=r"dev_200\.jsonl:1: sub-question 'Where was #3 born\?' refers to #3"):
        import_bundle(src, tmp_path / "out")
    mus.write_text(good)
    tsv = src / "wikitablequestions" / "pristine-unseen-tables.tsv"
    tsv.write_text(tsv.read_text().replace("\tcsv/200-csv/1.csv", ""))
    with pytest.raises(DataError, match=r"pristine-unseen-tables\.tsv:3: expected 4 tab-separated fields, got 3"):
        import_bundle(src, tmp_path / "out")
    hp = src / "hotpotqa" / "dev_distractor_500.jsonl"
    hp.write_text(hp.read_text().replace('"question_text"', '"question"', 1))
    with pytest.raises(DataError, match=r"dev_distractor_500\.jsonl:1: field 'question_text' should be str"):
        import_bundle(src, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]  # nothing half-written
