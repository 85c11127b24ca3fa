"""
corpus.py: the knowledge bases and questions every other script reads.

The embedded default is a *fictional* mini-world generated from a seed, so no pretrained model can
answer from memory: people, cities, countries, organisations and books with attributes and
relations, rendered into three KBs

    data/<name>/kb/text.jsonl    {id, title, text}                encyclopedia passages
    data/<name>/kb/table.jsonl   {id, title, header, rows, text}  relational tables (+ linearised
                                                                  text)
    data/<name>/kb/image.jsonl   {id, title, caption, path}       PNG images drawn with PIL
                                                                  (kb/images/)
    data/<name>/questions/{train,dev,test}.jsonl
        {id, question, answers: [answer, *aliases], type, pattern,
         steps: [{sub_question, kb, doc_id, answer}]}
    data/<name>/questions/visual_{train,dev,test}.jsonl   the same + image:
        "questions/images/vq12.png" (relative to the data folder), a flag, logo or portrait of the
        image KB re-drawn; step 1 asks the image KB who is shown
    data/<name>/questions/test_heldout.jsonl   with --holdout_pairs only: 2-hop questions of the
        held-out pairs
    data/<name>/questions/test_{worded,reworded}.jsonl   with --reworded only: the same new 2-hop
        questions, worded as the training questions are and with a second wording of each noun
        phrase (REWORDED)

Each attribute lives in exactly one KB (birthplaces in text, currencies in tables, hair colours in
portraits, ...), so routing is learnable from *what* a sub-question asks, while every entity type
(and words like "year", "city", "colour") appears in several KBs, so it is not guessable from one
keyword. `steps == []` means no retrieval needed.

Run:
    python corpus.py --world mini --out data/mini                 # ~4k documents, 5k + 900 visual
        # questions, seconds
    python corpus.py --world mini --out data/big --n_people 5000 --n_train 20000
    python corpus.py --world mini --out data/mini-no3hop --holdout 3hop   # no 3-hop chains in train
        # and dev
    python corpus.py --world mini --out data/mini-pairs --holdout_pairs 4 # 4 relation pairs
        # composed in no train or dev chain (each of their relations in other pairs of train), and
        # questions/test_heldout.jsonl: 300 2-hop questions of those pairs (--n_test_heldout;
        # `evaluate.py --data data/mini-pairs --split test_heldout`).
        # Or name the pairs: --holdout_pairs 'born_in>founded_city' 'hq>temperature'
    python corpus.py --world mini --out data/mini-rw --reworded 300   # questions/test_worded.jsonl:
        # 300 new 2-hop questions; questions/test_reworded.jsonl: the same with each noun phrase
        # worded as no training question is
    python corpus.py --check data/mini                            # validate every file, report
        # path:line errors

The public benchmarks (HotpotQA, 2WikiMultihopQA, MuSiQue, WikiTableQuestions, TabFact, ...) come
into the same layout through importers.py.

Outline: the mini-world (entities, KBs, questions) -> --check. Reading, writing and checking the
files: dataio.py.
"""
import argparse
import hashlib
import json
import os
import random
import re
import shutil
import sys
from collections import Counter
from pathlib import Path

from dataio import KBS, DataError, load_kb, load_questions, write_jsonl

# --------------------------------------------------------------------------------------------------
# The fictional world

SYL = ("ka ra lo mi ve to na sel dor vin tha bre quo ly zan fe ri ost ul mar ke pa gri ju hal nor "
       "esk tav bel cor dra fin gol hes iv jor lan mon per rus sto tor val wen yar zel").split()
COLOURS = ["red", "blue", "green", "yellow", "black", "white", "orange", "purple"]
RGB = {"red": (200, 30, 40), "blue": (30, 70, 200), "green": (30, 150, 60),
       "yellow": (240, 210, 40), "black": (20, 20, 20), "white": (250, 250, 250),
       "orange": (240, 130, 30), "purple": (120, 50, 160), "brown": (110, 70, 40),
       "blonde": (235, 200, 120), "grey": (150, 150, 150)}
HAIR = ["black", "brown", "blonde", "red", "grey", "white"]
SHAPES = ["circle", "square", "triangle", "diamond", "star", "hexagon"]
EMBLEMS = ["none", "circle", "star", "triangle"]
OCCUPATIONS = ["painter", "engineer", "novelist", "physician", "architect", "chemist", "lawyer",
               "composer", "economist", "sculptor", "botanist", "journalist"]
INDUSTRIES = ["shipping", "software", "mining", "textile", "publishing", "aerospace", "brewing",
              "banking"]
GENRES = ["mystery", "romance", "science fiction", "historical", "fantasy", "thriller", "poetry"]
CONTINENTS = ["Arvenia", "Suldor", "Mireth", "Ostalin"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September",
          "October", "November", "December"]
YEARS = list(range(2015, 2023))

def _word(rng, lo, hi):
    return "".join(rng.choice(SYL) for _ in range(rng.randint(lo, hi))).capitalize()

def _names(rng, n, make):
    out, seen = [], set()
    while len(out) < n:
        name = make()
        if name not in seen:
            seen.add(name)
            out.append(name)
    return out

def build_world(args):
    """Entities as plain dicts; every relation is a field pointing at another entity's index."""
    rng = random.Random(args.seed)
    countries = [dict(name=n, continent=rng.choice(CONTINENTS), currency=_word(rng, 1, 2).lower(),
                      language=_word(rng, 2, 2) + "ish",
                      population=rng.randint(1, 90) * 100_000 + rng.randint(0, 99_999),
                      flag=dict(orient=rng.choice(["horizontal", "vertical"]),
                                colours=rng.sample(COLOURS, rng.choice([2, 3])),
                                emblem=rng.choice(EMBLEMS), emblem_colour=rng.choice(COLOURS)))
                 for n in _names(rng, args.n_countries,
                                 lambda: _word(rng, 2, 3) + rng.choice(["ia", "a", "and", "ora"]))]
    cities = [dict(name=n, country=i % len(countries), founded=rng.randint(800, 1900),
                   climate=[rng.randint(-5, 12) + round(14 * (1 - abs(m - 6.5) / 6))
                            for m in range(12)],
                   rain=[rng.randint(10, 150) for _ in range(12)])
              for i, n in enumerate(_names(rng, args.n_cities,
                                           lambda: _word(rng, 2, 3)
                                           + rng.choice(["", "burg", "ton", "port", "mere"])))]
    for k, c in enumerate(countries):  # the capital is a city of that country
        c["capital"] = rng.choice([i for i, city in enumerate(cities) if city["country"] == k])
    people = [dict(name=n, born=rng.randint(1930, 2000), city=rng.randrange(len(cities)),
                   occupation=rng.choice(OCCUPATIONS), hair=rng.choice(HAIR),
                   shirt=rng.choice(COLOURS),
                   glasses=rng.random() < 0.4, org=None, spouse=None, works=[])
              for n in _names(rng, args.n_people,
                              lambda: f"{_word(rng, 1, 2)} {_word(rng, 2, 3)}")]
    orgs = [dict(name=n, industry=rng.choice(INDUSTRIES), founded=rng.randint(1850, 2010),
                 hq=rng.randrange(len(cities)), founder=rng.randrange(len(people)),
                 logo=dict(shape=rng.choice(SHAPES), colour=rng.choice(COLOURS)),
                 # year -> (employees, revenue)
                 results={y: (rng.randint(20, 900) * 10, rng.randint(5, 990)) for y in YEARS})
            for n in _names(rng, args.n_orgs,
                            lambda: f"""{_word(rng, 2, 3)} {rng.choice(['Dynamics', 'Works',
                                                                        'Group', 'Holdings',
                                                                        'Labs', 'Trading',
                                                                        'Press', 'Mills'])}""")]
    for p in people:
        if rng.random() < 0.8:
            p["org"] = rng.randrange(len(orgs))
    order = list(range(len(people)))
    rng.shuffle(order)
    # a third of people are married couples
    for a, b in zip(order[0:len(order) // 3:2], order[1:len(order) // 3:2]):
        people[a]["spouse"], people[b]["spouse"] = b, a
    for c, city in enumerate(cities):  # each city's mayor is a distinct person
        city["mayor"] = order[-1 - c]
    works = []
    for t in _names(rng, args.n_works,
                    lambda: "The " + rng.choice(["Silent", "Hidden", "Last", "Golden", "Broken",
                                                 "Distant", "Crimson", "Northern", "Glass", "Iron"])
                    + " " + _word(rng, 2, 3)):
        # authors are concentrated, so bibliographies have several rows
        author = rng.randrange(len(people) // 2)
        used = {w["year"] for w in (works[i] for i in people[author]["works"])}
        # one book per author per year: unambiguous
        year = rng.choice([y for y in range(1950, 2024) if y not in used])
        people[author]["works"].append(len(works))
        works.append(dict(title=t, author=author, year=year, genre=rng.choice(GENRES)))
    return dict(countries=countries, cities=cities, people=people, orgs=orgs, works=works)

# --------------------------------------------------------------------------------------------------
# Rendering the world into the three KBs

def flag_caption(f):
    stripes = (f"{len(f['colours'])} {f['orient']} stripes of {', '.join(f['colours'][:-1])} and "
               f"{f['colours'][-1]}")
    emblem = ("" if f["emblem"] == "none"
              else f", with a {f['emblem_colour']} {f['emblem']} in the centre")
    return stripes + emblem

def a_an(word):
    """The indefinite article before `word`, by its first letter."""
    return "an" if word[0] in "aeiou" else "a"

def render_kbs(w):
    C, P, O = w["cities"], w["people"], w["orgs"]
    text, table, image = [], [], []
    for i, p in enumerate(P):
        s = (f"{p['name']} (born {p['born']}) is a {p['occupation']} who was born in "
             f"{C[p['city']]['name']}.")
        if p["org"] is not None:
            s += f" {p['name']} works for {O[p['org']]['name']}."
        if p["spouse"] is not None:
            s += f" {p['name']} is married to {P[p['spouse']]['name']}."
        if p["works"]:
            s += (f" As a writer, {p['name']} has published {len(p['works'])} "
                  f"book{'s' if len(p['works']) > 1 else ''}.")
        text.append(dict(id=f"text-person-{i}", title=p["name"], text=s))
        image.append(dict(id=f"image-portrait-{i}", title=f"Portrait of {p['name']}",
                          path=f"images/portrait-{i}.png",
                          caption=f"Portrait of {p['name']}: a person with {p['hair']} hair"
                                  f"{' wearing glasses' if p['glasses'] else ''} and "
                                  f"{a_an(p['shirt'])} {p['shirt']} "
                                  "shirt."))
        if p["works"]:
            rows = sorted([[str(w['works'][k]['year']), w['works'][k]['title'],
                            w['works'][k]['genre']] for k in p["works"]])
            table.append(dict(id=f"table-biblio-{i}", title=f"Bibliography of {p['name']}",
                              header=["year", "title", "genre"], rows=rows))
    for i, c in enumerate(C):
        text.append(dict(id=f"text-city-{i}", title=c["name"], text=(
            f"{c['name']} is a city in {w['countries'][c['country']]['name']}, founded in "
            f"{c['founded']}. The current mayor of {c['name']} is {P[c['mayor']]['name']}.")))
        table.append(dict(id=f"table-climate-{i}", title=f"Climate of {c['name']}",
                          header=["month", "average high (°C)", "rainfall (mm)"],
                          rows=[[m, str(t), str(r)]
                                for m, t, r in zip(MONTHS, c["climate"], c["rain"])]))
    for i, k in enumerate(w["countries"]):
        text.append(dict(id=f"text-country-{i}", title=k["name"], text=(
            f"{k['name']} is a country on the continent of {k['continent']}. "
            f"""Its cities include {', '.join(c['name'] for c in C if c is not C[k['capital']]
                                              and w['countries'][c['country']] is k)}.""")))
        table.append(dict(id=f"table-country-{i}", title=f"{k['name']} at a glance",
                          header=["attribute", "value"],
                          rows=[["capital", C[k["capital"]]["name"]], ["currency", k["currency"]],
                                ["official language", k["language"]],
                                ["population", str(k["population"])]]))
        image.append(dict(id=f"image-flag-{i}", title=f"Flag of {k['name']}",
                          path=f"images/flag-{i}.png",
                          caption=f"Flag of {k['name']}: {flag_caption(k['flag'])}."))
    for i, o in enumerate(O):
        text.append(dict(id=f"text-org-{i}", title=o["name"], text=(
            f"{o['name']} is a {o['industry']} company founded in {o['founded']} by "
            f"{P[o['founder']]['name']}. It is headquartered in {C[o['hq']]['name']}.")))
        table.append(dict(id=f"table-results-{i}", title=f"Annual results of {o['name']}",
                          header=["year", "employees", "revenue (million)"],
                          rows=[[str(y), str(e), str(r)] for y, (e, r) in o["results"].items()]))
        image.append(dict(id=f"image-logo-{i}", title=f"Logo of {o['name']}",
                          path=f"images/logo-{i}.png",
                          caption=f"Logo of {o['name']}: "
                                  f"{a_an(o['logo']['colour'])} "
                                  f"{o['logo']['colour']} {o['logo']['shape']} on a white "
                                  "background."))
    for i, b in enumerate(w["works"]):
        text.append(dict(id=f"text-work-{i}", title=b["title"], text=(
            f"{b['title']} is a {b['genre']} book by {P[b['author']]['name']}.")))
    for t in table:
        t["text"] = linearise(t)
    return dict(text=text, table=table, image=image)

def linearise(t):
    """The text a retriever indexes for a table: title, header, then rows, cells joined by ' | '."""
    return " ; ".join([t["title"], " | ".join(t["header"])] + [" | ".join(r) for r in t["rows"]])

def draw_image(kind, ent):
    """The image-KB picture of an entity (a PIL image): a country's flag, an organisation's logo or
    a person's portrait."""
    from PIL import Image, ImageDraw
    if kind == "flag":
        f = ent["flag"]
        img = Image.new("RGB", (120, 80), "white")
        d = ImageDraw.Draw(img)
        n = len(f["colours"])
        for j, col in enumerate(f["colours"]):
            box = ((0, j * 80 // n, 120, (j + 1) * 80 // n) if f["orient"] == "horizontal"
                   else (j * 120 // n, 0, (j + 1) * 120 // n, 80))
            d.rectangle(box, fill=RGB[col])
        _shape(d, f["emblem"], (60, 40), 16, RGB[f["emblem_colour"]])
    elif kind == "logo":
        img = Image.new("RGB", (96, 96), "white")
        _shape(ImageDraw.Draw(img), ent["logo"]["shape"], (48, 48), 36, RGB[ent["logo"]["colour"]])
    else:  # portrait: shirt, face, hair, glasses
        img = Image.new("RGB", (96, 96), (225, 235, 245))
        d = ImageDraw.Draw(img)
        d.rectangle((18, 70, 78, 96), fill=RGB[ent["shirt"]])
        d.ellipse((24, 14, 72, 34), fill=RGB[ent["hair"]])
        d.ellipse((28, 20, 68, 68), fill=(240, 200, 170))
        d.chord((26, 12, 70, 44), 180, 360, fill=RGB[ent["hair"]])
        if ent["glasses"]:
            for x in (34, 52):
                d.ellipse((x, 36, x + 11, 46), outline=(10, 10, 10), width=2)
    return img

def vary_image(img, rng):
    """A KB picture re-drawn for a question, visibly different: rescaled, slightly rotated, framed,
    speckled."""
    from PIL import Image, ImageOps
    s = rng.uniform(1.2, 2.0)
    img = img.resize((round(img.width * s), round(img.height * s)), Image.BILINEAR)
    # same size: the corners are cut off
    img = img.rotate(rng.uniform(-6, 6), Image.BILINEAR, fillcolor="white")
    grey = rng.randint(60, 200)
    img = ImageOps.expand(img, border=rng.randint(2, 6), fill=(grey, grey, grey))
    # 1% of the pixels become specks of random colour
    for _ in range(img.width * img.height // 100):
        img.putpixel((rng.randrange(img.width), rng.randrange(img.height)),
                     tuple(rng.randrange(256) for _ in range(3)))
    return img

def _shape(d, shape, centre, r, fill):
    import math
    x, y = centre
    if shape == "circle":
        d.ellipse((x - r, y - r, x + r, y + r), fill=fill, outline=(0, 0, 0))
    elif shape == "square":
        d.rectangle((x - r, y - r, x + r, y + r), fill=fill, outline=(0, 0, 0))
    elif shape in ("triangle", "diamond", "hexagon", "star"):
        n = {"triangle": 3, "diamond": 4, "hexagon": 6, "star": 10}[shape]
        pts = [(x + (r if k % 2 == 0 or shape != "star" else r * 0.45)
                * math.sin(2 * math.pi * k / n),
                y - (r if k % 2 == 0 or shape != "star" else r * 0.45)
                * math.cos(2 * math.pi * k / n)) for k in range(n)]
        d.polygon(pts, fill=fill, outline=(0, 0, 0))

# --------------------------------------------------------------------------------------------------
# Questions: chains of relations, each hop answered by one document of one KB

def number_aliases(n):
    return [str(n)] + ([f"{n:,}"] if n >= 1000 else [])

# name: (subject type, object type or None for a value, kb, sub-question template, noun-phrase
# template or None)
RELATIONS = {
    "born_in":   ("person", "city", "text", "Where was {s} born?", "the city where {s} was born"),
    "works_for": ("person", "org", "text", "Which organisation does {s} work for?",
                  "the organisation that {s} works for"),
    "spouse":    ("person", "person", "text", "Who is {s} married to?", "the spouse of {s}"),
    "birth_year": ("person", None, "text", "In which year was {s} born?", None),
    "occupation": ("person", None, "text", "What is the occupation of {s}?", None),
    "mayor":     ("city", "person", "text", "Who is the mayor of {s}?", "the mayor of {s}"),
    "in_country": ("city", "country", "text", "Which country is {s} in?",
                   "the country that {s} is in"),
    "founded_city": ("city", None, "text", "In which year was the city of {s} founded?", None),
    "continent": ("country", None, "text", "On which continent is {s}?", None),
    "founder":   ("org", "person", "text", "Who founded {s}?", "the founder of {s}"),
    "hq":        ("org", "city", "text", "In which city is {s} headquartered?",
                  "the city where {s} is headquartered"),
    "industry":  ("org", None, "text", "In which industry does {s} operate?", None),
    "author":    ("work", "person", "text", "Who wrote {s}?", "the author of {s}"),
    "capital":   ("country", "city", "table", "What is the capital of {s}?", "the capital of {s}"),
    "currency":  ("country", None, "table", "What is the currency of {s}?", None),
    "language":  ("country", None, "table", "What is the official language of {s}?", None),
    "population": ("country", None, "table", "What is the population of {s}?", None),
    "employees": ("org", None, "table", "How many employees did {s} have in {year}?", None),
    "revenue":   ("org", None, "table", "What was the revenue of {s} in {year}, in millions?",
                  None),
    "book_in":   ("person", "work", "table", "Which book did {s} publish in {year}?",
                  "the book that {s} published in {year}"),
    "temperature": ("city", None, "table",
                    "What is the average high temperature in {s} in {month}, in °C?", None),
    "rainfall":  ("city", None, "table", "How much rain, in mm, falls in {s} in {month}?", None),
    "hair":      ("person", None, "image", "What colour is the hair of {s}?", None),
    "shirt":     ("person", None, "image", "What colour is the shirt {s} wears in the portrait?",
                  None),
    "glasses":   ("person", None, "image", "Does {s} wear glasses in the portrait?", None),
    "logo_shape": ("org", None, "image", "What shape is the logo of {s}?", None),
    "logo_colour": ("org", None, "image", "What colour is the logo of {s}?", None),
    "flag_stripes": ("country", None, "image", "How many stripes does the flag of {s} have?", None),
    "flag_emblem": ("country", None, "image", "What symbol is in the centre of the flag of {s}?",
                    None),
}
# the KBs a question's last hop can ask: those with a value relation (a new row of dataio.KB_TABLE
# has none here, its documents and questions come from elsewhere)
VALUE_KBS = [k for k in KBS if any(v[2] == k and v[1] is None for v in RELATIONS.values())]

def _template_re(tpl):
    """A sub-question template as a regex: {s} any name, {year} a number, {month} a month's name."""
    months = "(?:" + "|".join(MONTHS) + ")"
    return re.compile(re.escape(tpl).replace(r"\{s\}", ".+").replace(r"\{year\}", r"\d+")
                      .replace(r"\{month\}", months) + "$")

# A second noun phrase for each entity-valued relation, for questions worded otherwise than any
# training question (--reworded); the sub-questions stay RELATIONS', so a reworded chain asks for
# the steps the policy was trained on
REWORDED = {"born_in": "the birthplace of {s}", "works_for": "the employer of {s}",
            "spouse": "the person {s} is married to", "mayor": "the person who is mayor of {s}",
            "in_country": "the country containing {s}", "founder": "the person who founded {s}",
            "hq": "the city hosting the headquarters of {s}", "author": "the writer of {s}",
            "capital": "the capital city of {s}", "book_in": "the book {s} released in {year}"}

SUB_QUESTION_RE = {rel: _template_re(v[3]) for rel, v in RELATIONS.items()}

def relations(q):
    """The relation of each step of a question, read off its sub-question (the question files do not
    name them)."""
    out = []
    for s in q["steps"]:
        hits = [rel for rel, pat in SUB_QUESTION_RE.items() if pat.match(s["sub_question"])]
        if len(hits) != 1:
            raise DataError(f"question {q.get('id')}: sub-question {s['sub_question']!r} fits "
                            f"{len(hits)} relation templates, not 1")
        out.append(hits[0])
    return out

def kb_pattern(q):
    """The KBs of a question's gold steps, in order ("text>table"; "none" without retrieval)."""
    return ">".join(s["kb"] for s in q["steps"]) or "none"

def chain_pairs(q):
    """The compositions (relation, next relation) a 2-hop or 3-hop chain question makes; none for
    other types."""
    if q["type"] not in ("2hop", "3hop"):
        return set()
    rels = relations(q)
    return set(zip(rels, rels[1:]))

def apply(w, rel, etype, e, rng, year=None):
    """Follow relation `rel` from entity index `e`: (object index or [answer, *aliases], doc id,
    template params), or None."""
    year, month = year or rng.choice(YEARS), rng.randrange(12)
    x = entities(w)[etype][e]
    r = {
        "born_in": lambda: (x["city"], f"text-person-{e}", {}),
        "works_for": lambda: x["org"] is not None and (x["org"], f"text-person-{e}", {}),
        "spouse": lambda: x["spouse"] is not None and (x["spouse"], f"text-person-{e}", {}),
        "birth_year": lambda: ([str(x["born"])], f"text-person-{e}", {}),
        "occupation": lambda: ([x["occupation"]], f"text-person-{e}", {}),
        "mayor": lambda: (x["mayor"], f"text-city-{e}", {}),
        "in_country": lambda: (x["country"], f"text-city-{e}", {}),
        "founded_city": lambda: ([str(x["founded"])], f"text-city-{e}", {}),
        "continent": lambda: ([x["continent"]], f"text-country-{e}", {}),
        "founder": lambda: (x["founder"], f"text-org-{e}", {}),
        "hq": lambda: (x["hq"], f"text-org-{e}", {}),
        "industry": lambda: ([x["industry"]], f"text-org-{e}", {}),
        "author": lambda: (x["author"], f"text-work-{e}", {}),
        "capital": lambda: (x["capital"], f"table-country-{e}", {}),
        "currency": lambda: ([x["currency"]], f"table-country-{e}", {}),
        "language": lambda: ([x["language"]], f"table-country-{e}", {}),
        "population": lambda: (number_aliases(x["population"]), f"table-country-{e}", {}),
        "employees": lambda: (number_aliases(x["results"][year][0]), f"table-results-{e}",
                              {"year": year}),
        "revenue": lambda: (number_aliases(x["results"][year][1]), f"table-results-{e}",
                            {"year": year}),
        "book_in": lambda: bool(x.get("works")) and _book(w, x, e, rng),
        "temperature": lambda: ([str(x["climate"][month])], f"table-climate-{e}",
                                {"month": MONTHS[month]}),
        "rainfall": lambda: ([str(x["rain"][month])], f"table-climate-{e}",
                             {"month": MONTHS[month]}),
        "hair": lambda: ([x["hair"]], f"image-portrait-{e}", {}),
        "shirt": lambda: ([x["shirt"]], f"image-portrait-{e}", {}),
        "glasses": lambda: (["yes" if x["glasses"] else "no"], f"image-portrait-{e}", {}),
        "logo_shape": lambda: ([x["logo"]["shape"]], f"image-logo-{e}", {}),
        "logo_colour": lambda: ([x["logo"]["colour"]], f"image-logo-{e}", {}),
        "flag_stripes": lambda: ([str(len(x["flag"]["colours"])),
                                  ["two", "three"][len(x["flag"]["colours"]) - 2]],
                                 f"image-flag-{e}", {}),
        "flag_emblem": lambda: x["flag"]["emblem"] != "none" and ([x["flag"]["emblem"]],
                                                                  f"image-flag-{e}", {}),
    }[rel]()
    return r or None

def _book(w, x, e, rng):
    k = rng.choice(x["works"])
    return k, f"table-biblio-{e}", {"year": w["works"][k]["year"]}

def entities(w):
    return {"person": w["people"], "city": w["cities"], "org": w["orgs"],
            "country": w["countries"], "work": w["works"]}

def entity_name(w, etype, e):
    ent = entities(w)[etype][e]
    return ent.get("name") or ent["title"]

def follow(w, rels, etype, e, phrase, rng, reworded=False):
    """Walk the relations `rels` from entity `e`, which the question calls `phrase`: (question,
    answers, steps), or None when a hop does not apply (e.g. the person has no spouse). reworded:
    each hop's noun phrase from REWORDED (the same draws from rng, so the same entities, steps and
    answers)."""
    steps = []
    for rel in rels:
        out = apply(w, rel, etype, e, rng)
        if out is None:
            return None
        obj, doc, params = out
        _, otype, kb, sub_tpl, np_tpl = RELATIONS[rel]
        answers = obj if otype is None else [entity_name(w, otype, obj)]
        steps.append(dict(sub_question=sub_tpl.format(s=entity_name(w, etype, e), **params), kb=kb,
                          doc_id=doc, answer=answers[0]))
        question = sub_tpl.format(s=phrase, **params)
        phrase = ((REWORDED[rel] if reworded else np_tpl).format(s=phrase, **params) if np_tpl
                  else None)
        etype, e = otype, obj
    return question, answers, steps

def chain_question(w, hops, rng, reworded=False):
    """A question of `hops` relations: pick the last (value) relation, then walk backwards to a
    start entity."""
    # choose the KB of the final hop first, so the KBs are equally represented
    kb = rng.choice(VALUE_KBS)
    rels = [rng.choice([r for r, v in RELATIONS.items() if v[2] == kb and v[1] is None])]
    # prepend an entity-valued relation whose object is the next hop's subject
    while len(rels) < hops:
        options = [r for r, v in RELATIONS.items() if v[1] == RELATIONS[rels[0]][0]]
        rels.insert(0, rng.choice(options))
    return chain(w, rels, rng, reworded)

def chain(w, rels, rng, reworded=False):
    """A question along the relations `rels` from a random start entity, retried until every hop
    applies (or None)."""
    for _ in range(50):
        etype = RELATIONS[rels[0]][0]
        e = rng.randrange(len(entities(w)[etype]))
        if out := follow(w, rels, etype, e, entity_name(w, etype, e), rng, reworded):
            question, answers, steps = out
            return dict(question=question, answers=answers, type=f"{len(rels)}hop", steps=steps)
    return None

# kind of image-KB picture -> (entity type, sub-question of the image step, how the question names
# the entity shown)
VISUAL = {"flag": ("country", "Which country's flag is shown in the image?",
                   "the country whose flag is shown"),
          "logo": ("org", "Which organisation's logo is shown in the image?",
                   "the organisation whose logo is shown"),
          "portrait": ("person", "Who is the person in the portrait?",
                       "the person in the portrait")}

def visual_question(w, kind, e, rng):
    """A question about the picture of entity `e`: step 1 asks the image KB who is shown, then 1 or
    2 hops from there as in chain_question (entity-valued relations, then a value relation)."""
    etype, sub_question, phrase = VISUAL[kind]
    # the KB of the final hop first, as in chain_question
    kb, hops = rng.choice(VALUE_KBS), rng.choice([1, 2])
    values = [r for r, v in RELATIONS.items() if v[2] == kb and v[1] is None]
    # not the shown entity's own image attributes: the picture itself answers those
    if hops == 1:
        options = [[r] for r in values if RELATIONS[r][0] == etype and kb != "image"]
    else:
        options = [[r, v] for r, x in RELATIONS.items() if x[0] == etype and x[1]
                   for v in values if RELATIONS[v][0] == x[1]]
    out = follow(w, rng.choice(options), etype, e, phrase, rng) if options else None
    if out is None:
        return None
    question, answers, steps = out
    first = dict(sub_question=sub_question, kb="image", doc_id=f"image-{kind}-{e}",
                 answer=entity_name(w, etype, e))
    return dict(question=question, answers=answers, type="visual", steps=[first, *steps])

def make_visual_questions(w, pool, n, rng):
    """n visual questions about the (kind, entity index) pictures in `pool`, no (question, entity)
    pair twice."""
    out, seen = [], set()
    # bounded: a small pool holds only so many distinct questions
    for _ in range(200 * n if pool else 0):
        if len(out) == n:
            break
        kind, e = rng.choice(pool)
        q = visual_question(w, kind, e, rng)
        if q is None or (q["question"], kind, e) in seen:
            continue
        seen.add((q["question"], kind, e))
        q["pattern"] = kb_pattern(q)
        out.append(q)
    if len(out) < n:
        raise DataError(f"only {len(out)} distinct visual questions about the {len(pool)} uniquely "
                        f"drawn pictures, {n} asked for; lower --n_visual_train/dev/test")
    # the sampler runs out of some kinds of question first: spread them evenly over the splits
    rng.shuffle(out)
    return [dict(id=f"vq{i}", **q, image=f"questions/images/vq{i}.png") for i, q in enumerate(out)]

def comparison_question(w, rng):
    """Two parallel lookups of the same attribute, then a comparison: the answer is one of the two
    names, or yes/no."""
    P, O = w["people"], w["orgs"]
    kind = rng.choice(["older", "employees", "same_org"])
    year = None
    if kind == "older":
        a, b = rng.sample(range(len(P)), 2)
        if P[a]["born"] == P[b]["born"]:
            return None
        q = f"Who was born earlier, {P[a]['name']} or {P[b]['name']}?"
        rel, etype, ans = "birth_year", "person", [P[min(a, b, key=lambda i: P[i]["born"])]["name"]]
    elif kind == "employees":
        a, b = rng.sample(range(len(O)), 2)
        year = rng.choice(YEARS)
        if O[a]["results"][year][0] == O[b]["results"][year][0]:
            return None
        q = f"Which organisation had more employees in {year}, {O[a]['name']} or {O[b]['name']}?"
        rel, etype, ans = ("employees", "org",
                           [O[max(a, b, key=lambda i: O[i]["results"][year][0])]["name"]])
    else:
        a, b = rng.sample([i for i, p in enumerate(P) if p["org"] is not None], 2)
        q = f"Do {P[a]['name']} and {P[b]['name']} work for the same organisation?"
        rel, etype, ans = "works_for", "person", ["yes" if P[a]["org"] == P[b]["org"] else "no"]
    steps = []
    for e in (a, b):
        obj, doc, params = apply(w, rel, etype, e, rng, year=year)
        otype = RELATIONS[rel][1]
        steps.append(dict(sub_question=RELATIONS[rel][3].format(s=entity_name(w, etype, e),
                                                                **params),
                          kb=RELATIONS[rel][2], doc_id=doc,
                          answer=obj[0] if otype is None else entity_name(w, otype, obj)))
    return dict(question=q, answers=ans, type="comparison", steps=steps)

def no_retrieval_question(rng):
    kind = rng.randrange(4)
    if kind == 0:
        a, b = rng.randint(2, 60), rng.randint(2, 60)
        return dict(question=f"What is {a} plus {b}?", answers=[str(a + b)], type="none", steps=[])
    if kind == 1:
        a, b = rng.randint(2, 12), rng.randint(2, 12)
        return dict(question=f"What is {a} times {b}?", answers=[str(a * b)], type="none", steps=[])
    if kind == 2:
        m = rng.randrange(12)
        return dict(question=f"Which month comes after {MONTHS[m]}?",
                    answers=[MONTHS[(m + 1) % 12]], type="none", steps=[])
    shape, n = rng.choice([("triangle", 3), ("square", 4), ("pentagon", 5), ("hexagon", 6),
                           ("octagon", 8)])
    return dict(question=f"How many sides does a {shape} have?", answers=[str(n)], type="none",
                steps=[])

def make_questions(w, n, rng, seen=None, skip=(), first_id=0, pairs=()):
    """n questions of the mix, none of whose text is in `seen` (updated), whose type is in `skip` or
    whose chain composes one of the relation `pairs`."""
    mix = [("none", 0.1), (1, 0.3), (2, 0.3), (3, 0.15), ("comparison", 0.15)]
    out, seen = [], set() if seen is None else seen
    while len(out) < n:
        kind = rng.choices([m for m, _ in mix], weights=[p for _, p in mix])[0]
        q = (no_retrieval_question(rng) if kind == "none"
             else comparison_question(w, rng) if kind == "comparison"
             else chain_question(w, kind, rng))
        if (q is None or q["question"] in seen or q["type"] in skip
                or (pairs and chain_pairs(q) & set(pairs))):
            continue
        seen.add(q["question"])
        q["pattern"] = kb_pattern(q)
        out.append(dict(id=f"q{first_id + len(out)}", **q))
    return out

def hold_out(w, qs, n_train, n_dev, held, rng, pairs=()):
    """--holdout / --holdout_pairs: the question types `held`, and the chains composing one of the
    relation `pairs`, left out of train and dev (a shape or a composition the policy never trains
    on), each dropped question replaced by a new one; the test split stays the default world's,
    question for question, so its held-out rows and the rest compare with every default-world
    result."""
    keep = [q for q in qs[:n_train + n_dev]
            if q["type"] not in held and not chain_pairs(q) & set(pairs)]
    more = make_questions(w, n_train + n_dev - len(keep), rng, {q["question"] for q in qs}, held,
                          first_id=len(qs), pairs=pairs)
    both = keep + more
    return both[:n_train], both[n_train:]

def two_hop_pairs(qs, exclude=()):
    """{(relation 1, relation 2): count} over the 2-hop questions of qs, the pairs in `exclude` left
    out."""
    return Counter(p for q in qs if q["type"] == "2hop" for p in chain_pairs(q) if p not in exclude)

def pick_pairs(spec, train, rng):
    """--holdout_pairs: ['N'] -> N pairs of the train split's 2-hop chains in a seeded shuffle's
    order, skipping a pair that would leave one of the held relations without another pair in train;
    ['rel1>rel2', ...] -> those."""
    if len(spec) == 1 and spec[0].isdigit():
        order = sorted(two_hop_pairs(train))
        rng.shuffle(order)
        held = []
        for pair in order:
            if len(held) < int(spec[0]) and not unseen_relations(train, held + [pair]):
                held.append(pair)
        if len(held) < int(spec[0]):
            raise DataError(f"--holdout_pairs {spec[0]}: only {len(held)} pairs can be held out "
                            f"with each relation still in another pair of train")
        return held
    held = []
    for s in spec:
        a, _, b = s.partition(">")
        if a not in RELATIONS or b not in RELATIONS or RELATIONS[a][1] is None \
                or RELATIONS[a][1] != RELATIONS[b][0] or RELATIONS[b][1] is not None:
            raise DataError(f"--holdout_pairs: {s!r} is not a 2-hop chain rel1>rel2 of RELATIONS "
                            f"(an entity relation, then a value relation of its object)")
        held.append((a, b))
    return held

def unseen_relations(train, held):
    """The held relations train lacks in another pair: a first hop not first in another 2-hop pair,
    a second hop not second in one (what makes a held pair a new composition of known hops, not a
    new hop)."""
    seen = two_hop_pairs(train, held)
    firsts, seconds = {a for a, _ in seen}, {b for _, b in seen}
    return sorted({a for a, _ in held if a not in firsts}
                  | {b for _, b in held if b not in seconds})

def heldout_questions(w, pairs, n, rng, seen):
    """n 2-hop questions of the held-out `pairs` (each draw a pair at random), none of whose text is
    in `seen`."""
    out = []
    # bounded: a pair from a small entity type holds only so many distinct questions
    for _ in range(200 * n):
        if len(out) == n:
            break
        q = chain(w, list(rng.choice(pairs)), rng)
        if q is None or q["question"] in seen:
            continue
        seen.add(q["question"])
        q["pattern"] = kb_pattern(q)
        out.append(dict(id=f"hp{len(out)}", **q))
    if len(out) < n:
        raise DataError(f"only {len(out)} distinct questions of the held-out pairs, {n} asked for; "
                        "lower --n_test_heldout")
    return out

def reworded_questions(w, n, rng, seen):
    """--reworded: n new 2-hop chain questions twice, (worded as every training question, reworded):
    the same ids, steps and answers, the second with each noun phrase from REWORDED. Their paired
    difference is what the wording alone costs a policy. None of either text is in `seen`."""
    worded, reworded = [], []
    for _ in range(200 * n):  # bounded: the world holds only so many distinct 2-hop questions
        if len(worded) == n:
            break
        draw = rng.getrandbits(64)  # the same draws for both wordings: the same chain
        a, b = (chain_question(w, 2, random.Random(draw), k) for k in (False, True))
        if a is None or a["question"] in seen or b["question"] in seen:
            continue
        seen.update((a["question"], b["question"]))
        for q, out in ((a, worded), (b, reworded)):
            out.append(dict(id=f"wq{len(out)}", **q, pattern=kb_pattern(q)))
    if len(worded) < n:
        raise DataError(f"only {len(worded)} distinct reworded questions, {n} asked for; lower "
                        "--reworded")
    return worded, reworded

def held_out_splits(w, qs, splits, args, rng):
    """--holdout / --holdout_pairs: new train and dev splits in `splits`, and with held-out pairs
    their test_heldout split; returns the held-out pairs."""
    # its own stream: the pick and the held-out split move nothing else
    held_rng = random.Random(args.seed + 3)
    pairs = pick_pairs(args.holdout_pairs, splits["train"], held_rng) if args.holdout_pairs else []
    splits["train"], splits["dev"] = hold_out(w, qs, args.n_train, args.n_dev, set(args.holdout),
                                              rng, pairs)
    if missing := unseen_relations(splits["train"], pairs):
        raise DataError(f"--holdout_pairs: {', '.join(missing)} in no other pair of train: a "
                        f"held-out pair would be a new relation, not a new composition")
    if pairs:
        # test's too: test_heldout repeats no question
        seen = {q["question"] for sp in splits.values() for q in sp}
        splits["test_heldout"] = heldout_questions(w, pairs, args.n_test_heldout, held_rng, seen)
    return pairs

# --------------------------------------------------------------------------------------------------

def generate_mini(args):
    from tqdm import tqdm
    w = build_world(args)
    kbs = render_kbs(w)
    rng = random.Random(args.seed + 1)
    qs = make_questions(w, args.n_train + args.n_dev + args.n_test, rng)
    splits = {"train": qs[:args.n_train], "dev": qs[args.n_train:args.n_train + args.n_dev],
              "test": qs[args.n_train + args.n_dev:]}
    pairs = held_out_splits(w, qs, splits, args, rng) if args.holdout or args.holdout_pairs else []
    if args.reworded:  # its own stream: the other splits do not move
        seen = {q["question"] for sp in splits.values() for q in sp}
        splits["test_worded"], splits["test_reworded"] = reworded_questions(
            w, args.reworded, random.Random(args.seed + 4), seen)
    ents = {"portrait": w["people"], "flag": w["countries"], "logo": w["orgs"]}
    pictures = {}  # (kind, entity index) -> its image-KB picture, in KB order
    for doc in tqdm(kbs["image"], desc="drawing images", disable=args.quiet):
        kind, i = doc["id"].split("-")[1:]
        pictures[kind, int(i)] = draw_image(kind, ents[kind][int(i)])
    # Visual questions come last, from their own generator, so the KBs and the text questions above
    # do not move. A question image must identify its entity, so only pictures no other entity
    # shares are shown: 1000 people have ~96 hair/shirt/glasses looks and 200 organisations 48
    # logos, so few portraits and logos qualify, most flags do.
    owners = {}  # digest of the pixels -> the (kind, entity index) pairs drawn with them
    for key, img in pictures.items():
        owners.setdefault(hashlib.sha1(repr(img.size).encode() + img.tobytes()).hexdigest(),
                          []).append(key)
    pool = [keys[0] for keys in owners.values() if len(keys) == 1]
    vrng = random.Random(args.seed + 2)
    vqs = make_visual_questions(w, pool, args.n_visual_train + args.n_visual_dev
                                + args.n_visual_test, vrng)
    a, b = args.n_visual_train, args.n_visual_train + args.n_visual_dev
    splits.update(visual_train=vqs[:a], visual_dev=vqs[a:b], visual_test=vqs[b:])
    out = Path(args.out)
    # build everything aside, then swap in: never half-written
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "kb" / "images").mkdir(parents=True)
    (tmp / "questions" / "images").mkdir(parents=True)
    for doc, img in zip(kbs["image"], pictures.values()):
        img.save(tmp / "kb" / doc["path"])
    for q in tqdm(vqs, desc="drawing question images", disable=args.quiet):
        kind, i = q["steps"][0]["doc_id"].split("-")[1:]
        vary_image(pictures[kind, int(i)], vrng).save(tmp / q["image"])
    # a KB the world has no documents for (a new row of dataio.KB_TABLE): an empty file to fill
    for kb in KBS:
        write_jsonl(tmp / "kb" / f"{kb}.jsonl", kbs.get(kb, []))
    for split, rows in splits.items():
        write_jsonl(tmp / "questions" / f"{split}.jsonl", rows)
    held = {"heldout_pairs": [">".join(p) for p in pairs]} if pairs else {}
    (tmp / "world.json").write_text(json.dumps(dict(seed=args.seed, args=vars(args), **held),
                                               indent=1))
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return kbs, splits

def check(data_dir):
    """Validate a data folder; returns counts. Raises DataError naming the file and line of the
    first problem."""
    counts = {kb: len(load_kb(data_dir, kb)) for kb in KBS}
    ids = {d["id"] for kb in KBS for d in load_kb(data_dir, kb)}
    # every split, not just train/dev/test
    for split in sorted(f.stem for f in (Path(data_dir) / "questions").glob("*.jsonl")):
        qs = load_questions(data_dir, split)
        for q in qs:
            for s in q["steps"]:
                if s["doc_id"] not in ids:
                    raise DataError(f"{data_dir}/questions/{split}.jsonl: question {q['id']} cites "
                                    f"unknown doc_id {s['doc_id']!r}")
        counts[split] = len(qs)
    return counts

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", default="mini", choices=["mini"], help="which corpus to build")
    ap.add_argument("--out", default="data/mini", help="output folder")
    ap.add_argument("--check", metavar="DIR", help="only validate an existing data folder")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--n_people", type=int, default=1000)
    ap.add_argument("--n_cities", type=int, default=150)
    ap.add_argument("--n_countries", type=int, default=30)
    ap.add_argument("--n_orgs", type=int, default=200)
    ap.add_argument("--n_works", type=int, default=600)
    ap.add_argument("--n_train", type=int, default=4000)
    ap.add_argument("--n_dev", type=int, default=500)
    ap.add_argument("--n_test", type=int, default=500)
    ap.add_argument("--n_visual_train", type=int, default=600,
                    help="questions about a picture (questions/visual_*.jsonl)")
    ap.add_argument("--n_visual_dev", type=int, default=100)
    ap.add_argument("--n_visual_test", type=int, default=200)
    ap.add_argument("--holdout", nargs="+", default=[],
                    choices=["1hop", "2hop", "3hop", "comparison", "none"],
                    help="question types left out of train and dev (a held-out shape; test "
                         "unchanged: hold_out)")
    ap.add_argument("--holdout_pairs", nargs="+", default=[], metavar="N | REL1>REL2",
                    help="2-hop relation pairs left out of train and dev (a held-out composition; "
                         "test unchanged): N drawn by a seeded rule (pick_pairs), or named, e.g. "
                         "'born_in>founded_city'; writes questions/test_heldout.jsonl")
    ap.add_argument("--n_test_heldout", type=int, default=300,
                    help="questions of the held-out pairs in test_heldout")
    ap.add_argument("--reworded", type=int, default=0, metavar="N",
                    help="N new 2-hop questions worded as in training "
                         "(questions/test_worded.jsonl) and the same questions reworded, each noun "
                         "phrase a second wording no training question uses "
                         "(questions/test_reworded.jsonl)")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args()
    try:
        if args.check:
            print(json.dumps(check(args.check)))
            sys.exit(0)
        kbs, splits = generate_mini(args)
    except DataError as e:
        sys.exit(f"error: {e}")
    print(f"wrote {args.out}: " + ", ".join(f"{len(v)} {k} docs" for k, v in kbs.items()) + "; "
          + ", ".join(f"{len(v)} {k} questions" for k, v in splits.items()))
    if "test_heldout" in splits:
        print("held out of train and dev: "
              f"{', '.join('>'.join(p) for p in sorted(two_hop_pairs(splits['test_heldout'])))}")
