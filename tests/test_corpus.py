"""corpus.py: determinism, schemas, internal consistency of the gold decompositions, images, loud errors on bad files."""
import hashlib
import json
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import corpus
import dataio
from conftest import tiny_world_args

ROOT = Path(__file__).resolve().parents[1]

def tree_digest(folder):
    """What corpus.py wrote: the index/ folder is retrievers.py's (the shared tiny_index fixture builds it into the world,
    before or after these tests depending on the order they run in)."""
    h = hashlib.sha256()
    for p in sorted(Path(folder).rglob("*")):
        if p.is_file() and p.name != "world.json" and p.relative_to(folder).parts[0] != "index":
            h.update(str(p.relative_to(folder)).encode())
            h.update(p.read_bytes())
    return h.hexdigest()

def holds(kb, doc):
    """The part of a document an answer must appear in."""
    return {"text": doc.get("text"), "table": json.dumps(doc.get("rows")), "image": doc.get("caption")}[kb]

VISUAL_SPLITS = ("visual_train", "visual_dev", "visual_test")

def test_generation_is_deterministic_and_seed_dependent(tmp_path, tiny_world):
    corpus.generate_mini(tiny_world_args(tmp_path / "again"))
    corpus.generate_mini(tiny_world_args(tmp_path / "other", seed=1))
    assert tree_digest(tmp_path / "again") == tree_digest(tiny_world)  # visual questions and their images included
    assert tree_digest(tmp_path / "other") != tree_digest(tiny_world)
    visual = lambda d: (d / "questions" / "visual_train.jsonl").read_bytes()
    assert visual(tmp_path / "other") != visual(tiny_world) and visual(tiny_world).count(b"\n") == 30

def test_visual_questions_leave_the_kbs_and_text_questions_unchanged(tmp_path, tiny_world):
    plain = tmp_path / "plain"
    corpus.generate_mini(tiny_world_args(plain, n_visual=(0, 0, 0)))
    assert tree_digest(plain / "kb") == tree_digest(tiny_world / "kb")
    for split in ("train", "dev", "test"):
        assert (plain / "questions" / f"{split}.jsonl").read_bytes() == (tiny_world / "questions" / f"{split}.jsonl").read_bytes()
    assert all(dataio.load_questions(plain, s) == [] for s in VISUAL_SPLITS)

def test_a_held_out_shape_leaves_train_and_dev_and_keeps_test(tmp_path, tiny_world):
    out = tmp_path / "no3hop"
    corpus.generate_mini(tiny_world_args(out, holdout=["3hop"]))
    assert tree_digest(out / "kb") == tree_digest(tiny_world / "kb")
    assert (out / "questions" / "test.jsonl").read_bytes() == (tiny_world / "questions" / "test.jsonl").read_bytes()
    test = dataio.load_questions(out, "test")
    assert any(q["type"] == "3hop" for q in test)
    train, dev = dataio.load_questions(out, "train"), dataio.load_questions(out, "dev")
    assert (len(train), len(dev)) == (120, 40) and not any(q["type"] == "3hop" for q in train + dev)
    texts = [q["question"] for q in train + dev + test]
    ids = [q["id"] for q in train + dev + test]
    assert len(set(texts)) == len(texts) and len(set(ids)) == len(ids)  # no question twice, none shared with test
    # the kept questions are the default world's, in order; the new ones fill the places of the dropped
    default = [q for q in dataio.load_questions(tiny_world, "train") if q["type"] != "3hop"]
    assert train[:len(default)] == default

# sha256 of the tiny default world's JSONL files (kb and questions; the PNGs' bytes depend on the PIL build), as
# generated before held-out pairs existed
TINY_WORLD_JSONL = "359db5f304ffcdfa75de57f8ba605f413254c458eccd1002f705876b3339ef70"

def jsonl_digest(folder):
    h = hashlib.sha256()
    for p in sorted(Path(folder).rglob("*.jsonl")):
        h.update(str(p.relative_to(folder)).encode())
        h.update(p.read_bytes())
    return h.hexdigest()

def test_no_held_out_pairs_leaves_the_default_world_as_it_was(tmp_path, tiny_world):
    a = tiny_world_args(tmp_path / "zero")  # the tiny world's sizes through the command line, --holdout_pairs 0
    sizes = [f"--{k}={getattr(a, k)}" for k in ("n_people", "n_cities", "n_countries", "n_orgs", "n_works", "n_train",
                                                 "n_dev", "n_test", "n_visual_train", "n_visual_dev", "n_visual_test")]
    subprocess.run([sys.executable, str(ROOT / "corpus.py"), "--out", a.out, *sizes, "--holdout_pairs", "0", "--quiet"],
                   check=True, capture_output=True)
    assert jsonl_digest(tiny_world) == jsonl_digest(tmp_path / "zero") == TINY_WORLD_JSONL
    assert tree_digest(tmp_path / "zero") == tree_digest(tiny_world)
    assert not (tiny_world / "questions" / "test_heldout.jsonl").exists()

def test_relations_are_read_off_the_sub_questions(tiny_world):
    qs = [q for s in ("train", "dev", "test") for q in dataio.load_questions(tiny_world, s) if q["type"].endswith("hop")]
    for q in qs:
        rels = corpus.relations(q)
        for i, (rel, s) in enumerate(zip(rels, q["steps"])):
            assert corpus.RELATIONS[rel][2] == s["kb"]
            if i:  # a chain: each relation starts where the one before it ends
                assert corpus.RELATIONS[rels[i - 1]][1] == corpus.RELATIONS[rel][0]
        assert corpus.chain_pairs(q) == (set(zip(rels, rels[1:])) if q["type"] != "1hop" else set())
    assert len(corpus.two_hop_pairs(qs)) > 10

def test_held_out_pairs_leave_train_and_dev_and_fill_their_own_test_split(tmp_path, tiny_world):
    out = tmp_path / "pairs"
    corpus.generate_mini(tiny_world_args(out, holdout_pairs=["2"], n_test_heldout=30))
    held = {tuple(p.split(">")) for p in json.loads((out / "world.json").read_text())["heldout_pairs"]}
    assert len(held) == 2
    assert tree_digest(out / "kb") == tree_digest(tiny_world / "kb")
    assert (out / "questions" / "test.jsonl").read_bytes() == (tiny_world / "questions" / "test.jsonl").read_bytes()
    train, dev, test = (dataio.load_questions(out, s) for s in ("train", "dev", "test"))
    assert (len(train), len(dev)) == (120, 40)
    assert not any(corpus.chain_pairs(q) & held for q in train + dev)  # 3-hop chains composing a held pair too
    assert any(corpus.chain_pairs(q) & held for q in dataio.load_questions(tiny_world, "train"))  # some were dropped
    seen = corpus.two_hop_pairs(train)  # each held relation composed in train, in its place, with another relation
    for a, b in held:
        assert any(x == a and (x, y) not in held for x, y in seen) and any(y == b and (x, y) not in held for x, y in seen)
    heldout = dataio.load_questions(out, "test_heldout")
    assert len(heldout) == 30 and corpus.check(out)["test_heldout"] == 30
    assert all(q["type"] == "2hop" and corpus.chain_pairs(q) <= held for q in heldout)
    assert set(corpus.two_hop_pairs(heldout)) == held
    texts = [q["question"] for q in train + dev + test + heldout]
    ids = [q["id"] for q in train + dev + test + heldout]
    assert len(set(texts)) == len(texts) and len(set(ids)) == len(ids)
    # named pairs; a pair that would leave a relation in no other pair of train fails in one line
    named = tmp_path / "named"
    corpus.generate_mini(tiny_world_args(named, holdout_pairs=["hq>founded_city"], n_test_heldout=5))
    assert [corpus.relations(q) for q in dataio.load_questions(named, "test_heldout")] == [["hq", "founded_city"]] * 5
    with pytest.raises(dataio.DataError, match="continent in no other pair of train"):  # in_country's only value
        corpus.generate_mini(tiny_world_args(tmp_path / "x", holdout_pairs=["in_country>continent"]))
    r = subprocess.run([sys.executable, str(ROOT / "corpus.py"), "--out", str(tmp_path / "y"), "--holdout_pairs",
                        "born_in>hair"], capture_output=True, text=True)
    assert r.returncode != 0 and r.stderr.count("\n") == 1 and "'born_in>hair' is not a 2-hop chain" in r.stderr

def test_reworded_questions_ask_the_trained_steps_in_words_no_training_question_uses(tmp_path, tiny_world):
    out = tmp_path / "rw"
    corpus.generate_mini(tiny_world_args(out, reworded=20))
    for split in ("train", "dev", "test", "visual_train"):  # the other splits as the default world's
        assert (out / "questions" / f"{split}.jsonl").read_bytes() == (tiny_world / "questions" / f"{split}.jsonl").read_bytes()
    worded, reworded = (dataio.load_questions(out, s) for s in ("test_worded", "test_reworded"))
    assert len(worded) == len(reworded) == 20 and corpus.check(out)["test_reworded"] == 20
    for a, b in zip(worded, reworded):  # the same chain: ids, steps, answers; only the question's words differ
        assert a["type"] == "2hop" and {k: v for k, v in a.items() if k != "question"} == \
            {k: v for k, v in b.items() if k != "question"} and a["question"] != b["question"]
        first = corpus.relations(a)[0]
        assert corpus.REWORDED[first].split("{s}")[0] in b["question"]
    trained = [q["question"] for sp in ("train", "dev", "test", "visual_train", "visual_dev", "visual_test")
               for q in dataio.load_questions(out, sp)]
    assert not {q["question"] for q in worded + reworded} & set(trained)
    assert len({q["question"] for q in worded + reworded}) == 40
    # no training question uses a second wording (each REWORDED phrase's fixed words, where RELATIONS' differ)
    for rel, tpl in corpus.REWORDED.items():
        words = tpl.replace("{year}", "{s}").split("{s}")
        assert not any(all(w in q for w in words if w.strip()) for q in trained), rel

def test_files_follow_the_schema(tiny_world):
    counts = corpus.check(tiny_world)
    assert counts["train"] == 120 and counts["dev"] == 40 and counts["test"] == 40
    assert (counts["visual_train"], counts["visual_dev"], counts["visual_test"]) == (30, 10, 10)
    assert all(counts[kb] > 0 for kb in dataio.KBS)
    for t in dataio.load_kb(tiny_world, "table"):
        assert all(len(r) == len(t["header"]) for r in t["rows"]), t["id"]
        assert t["text"] == corpus.linearise(t)

def test_gold_decompositions_are_consistent(tiny_world):
    docs = {d["id"]: (kb, d) for kb in dataio.KBS for d in dataio.load_kb(tiny_world, kb)}
    qs = [q for s in ("train", "dev", "test") for q in dataio.load_questions(tiny_world, s)]
    assert len({q["question"] for q in qs}) == len(qs), "questions repeat across splits"
    assert {q["type"] for q in qs} == {"none", "1hop", "2hop", "3hop", "comparison"}
    for q in qs:
        assert q["pattern"] == (">".join(s["kb"] for s in q["steps"]) or "none")
        for i, s in enumerate(q["steps"]):
            kb, doc = docs[s["doc_id"]]
            assert kb == s["kb"] and s["doc_id"].startswith(kb)
            if s["answer"] not in ("yes", "no"):  # the gold document really holds the intermediate answer
                assert s["answer"] in holds(kb, doc), (q["id"], s)
            if q["type"].endswith("hop") and i > 0:  # a chain: each sub-question names the previous answer
                assert q["steps"][i - 1]["answer"] in s["sub_question"]
        if q["type"].endswith("hop"):
            assert q["answers"][0] == q["steps"][-1]["answer"]
            assert len(q["steps"]) == int(q["type"][0])
        if q["type"] == "comparison":
            assert len(q["steps"]) == 2 and (q["answers"][0] in ("yes", "no") or q["answers"][0] in q["question"])

def test_visual_questions_follow_their_picture(tiny_world):
    docs = {d["id"]: (kb, d) for kb in dataio.KBS for d in dataio.load_kb(tiny_world, kb)}
    qs = [q for s in VISUAL_SPLITS for q in dataio.load_questions(tiny_world, s)]
    assert [q["id"] for q in qs] == [f"vq{i}" for i in range(50)]
    assert len({(q["question"], q["steps"][0]["doc_id"]) for q in qs}) == len(qs)
    assert {q["steps"][0]["doc_id"].split("-")[1] for q in qs} == {"flag", "logo", "portrait"}
    for q in qs:
        first, rest = q["steps"][0], q["steps"][1:]
        etype, sub_question, phrase = corpus.VISUAL[first["doc_id"].split("-")[1]]
        assert q["type"] == "visual" and q["pattern"] == ">".join(s["kb"] for s in q["steps"]) and len(rest) in (1, 2)
        assert first["kb"] == "image" and first["sub_question"] == sub_question
        assert docs[first["doc_id"]][1]["title"].endswith(f" of {first['answer']}")  # "Flag of <country>"
        assert phrase in q["question"] and first["answer"] not in q["question"]  # only the picture names the entity
        assert q["pattern"] != "image>image"  # no question about what the picture itself shows
        for prev, s in zip(q["steps"], rest):  # a chain from the entity shown: each hop names the previous answer
            kb, doc = docs[s["doc_id"]]
            assert kb == s["kb"] and prev["answer"] in s["sub_question"]
            if s["answer"] not in ("yes", "no"):
                assert s["answer"] in holds(kb, doc), (q["id"], s)
        assert q["answers"][0] == rest[-1]["answer"]

def test_question_images_redraw_a_uniquely_drawn_picture(tiny_world):
    docs = {d["id"]: d for d in dataio.load_kb(tiny_world, "image")}
    pixels = {i: Image.open(d["path"]).convert("RGB") for i, d in docs.items()}
    looks = Counter(p.tobytes() for p in pixels.values())
    assert max(looks.values()) > 1  # some pictures are shared, so the uniqueness rule does exclude entities
    for q in (q for s in VISUAL_SPLITS for q in dataio.load_questions(tiny_world, s)):
        image, gold = Path(q["image"]), q["steps"][0]["doc_id"]
        assert image == tiny_world / "questions" / "images" / f"{q['id']}.png"
        assert image.read_bytes() != Path(docs[gold]["path"]).read_bytes()
        assert Image.open(image).size != pixels[gold].size  # visibly re-drawn, not a copy
        assert looks[pixels[gold].tobytes()] == 1, (q["id"], gold)  # no other entity looks the same

def test_a_missing_question_image_is_one_line_naming_file_row_and_path(tmp_path, tiny_world):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_world, broken, ignore=shutil.ignore_patterns("index"))
    q = dataio.read_jsonl(broken / "questions" / "visual_dev.jsonl")[2]
    (broken / q["image"]).unlink()
    error = rf"visual_dev\.jsonl: row 3 \(id '{q['id']}'\): image file not found: .*{q['id']}\.png$"
    with pytest.raises(dataio.DataError, match=error):
        dataio.load_questions(broken, "visual_dev")
    with pytest.raises(dataio.DataError, match=error):
        corpus.check(broken)
    r = subprocess.run([sys.executable, str(ROOT / "corpus.py"), "--check", str(broken)], capture_output=True, text=True)
    assert r.returncode != 0 and r.stderr.count("\n") == 1 and "image file not found" in r.stderr

def test_a_missing_kb_image_fails_check_and_build_in_one_line(tmp_path, tiny_world):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_world, broken, ignore=shutil.ignore_patterns("index"))
    doc = dataio.read_jsonl(broken / "kb" / "image.jsonl")[4]
    (broken / "kb" / doc["path"]).unlink()
    error = rf"image\.jsonl: row 5 \(id '{doc['id']}'\): image file not found: .*{doc['path']}$"
    with pytest.raises(dataio.DataError, match=error):
        corpus.check(broken)
    for cmd in (["corpus.py", "--check"], ["retrievers.py", "build", "--methods", "bm25", "--data"]):
        r = subprocess.run([sys.executable, str(ROOT / cmd[0]), *cmd[1:], str(broken)], capture_output=True, text=True)
        assert r.returncode != 0 and r.stderr.strip().count("\n") == 0 and "image file not found" in r.stderr, r.stderr

def test_image_kb_holds_real_pngs_that_show_the_answer(tiny_world):
    rgb = corpus.RGB
    for d in dataio.load_kb(tiny_world, "image"):
        img = np.asarray(Image.open(d["path"]).convert("RGB"))
        if d["id"].startswith("image-logo"):  # centre pixel = the logo colour named in the caption
            colour = d["caption"].split(": ")[1].split()[1]
            assert tuple(img[48, 48]) == rgb[colour], d
        if d["id"].startswith("image-flag"):  # top-left pixel = the first stripe colour
            first = d["caption"].split(" stripes of ")[1].split(",")[0].split(" and ")[0]
            assert tuple(img[2, 2]) == rgb[first], d
        if d["id"].startswith("image-portrait"):  # top of the head = hair colour
            hair = d["caption"].split(" with ")[1].split(" hair")[0]
            assert tuple(img[15, 48]) == rgb[hair], d

def test_regenerating_replaces_atomically(tmp_path):
    out = tmp_path / "w"
    corpus.generate_mini(tiny_world_args(out))
    (out / "stale.txt").write_text("old")
    corpus.generate_mini(tiny_world_args(out))
    assert not (out / "stale.txt").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["w"]  # no temp folders left behind

def test_bad_files_get_path_and_line(tmp_path, tiny_world):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "title": "t", "text": "x"}\n{"id": "b", "title": \n')
    with pytest.raises(dataio.DataError, match=r"bad\.jsonl:2: not valid JSON \(Expecting value at column 22\)"):
        dataio.read_jsonl(bad)  # the column where the line is cut off, not column 1 of the line after it
    bad.write_text('{"id": "a", "title": "cut off\n')
    with pytest.raises(dataio.DataError, match=r"bad\.jsonl:1: not valid JSON \(Unterminated string starting at column 22\)$"):
        dataio.read_jsonl(bad)
    bad.write_text('[1, 2]\n')
    with pytest.raises(dataio.DataError, match=r"bad\.jsonl:1: expected a JSON object"):
        dataio.read_jsonl(bad)
    with pytest.raises(dataio.DataError, match="file not found"):
        dataio.read_jsonl(tmp_path / "missing.jsonl")
    q = tmp_path / "q" / "questions"
    q.mkdir(parents=True)
    (q / "dev.jsonl").write_text(json.dumps(dict(id="q0", question="?", answers=["a"], type="1hop",
                                                 steps=[dict(sub_question="?", kb="video", doc_id="x", answer="a")])) + "\n")
    with pytest.raises(dataio.DataError, match=r"row 1 .*steps\[0\]: kb 'video'"):
        dataio.load_questions(tmp_path / "q", "dev")
    (q / "dev.jsonl").write_text(json.dumps(dict(id="q0", question="?", answers=["a"], type="visual", steps=[], image=3)) + "\n")
    with pytest.raises(dataio.DataError, match=r"row 1 .*field 'image' should be str, got int"):
        dataio.load_questions(tmp_path / "q", "dev")

def test_cli_check_reports_errors_without_a_traceback(tmp_path, tiny_world):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_world, broken)
    lines = (broken / "kb" / "text.jsonl").read_text().splitlines()
    lines[4] = lines[4][:-5]
    (broken / "kb" / "text.jsonl").write_text("\n".join(lines) + "\n")
    r = subprocess.run([sys.executable, str(ROOT / "corpus.py"), "--check", str(broken)], capture_output=True, text=True)
    assert r.returncode != 0
    assert "text.jsonl:5: not valid JSON" in r.stderr and "Traceback" not in r.stderr
