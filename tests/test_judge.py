"""judge.py on hand-made cases: ragas' rating parser and average, each metric's two prompts and shortcuts, the cache
(hits, a resumed file, a line cut by a kill, a corrupt line), and evaluate.py's judge metric with its agreement with
EM. The same judge through a real vLLM OpenAI server is in tests/test_remote.py."""
import json

import pytest

import judge
import metrics
from dataio import DataError


class Replies:
    """A judge engine that answers each prompt by a rule, as a real judge's reply would read: what the Judge sends
    (rendered through the chat template) and how it parses the reply are judge.py's own."""
    def __init__(self, tok, reply):
        self.tok, self.reply, self.prompts = tok, reply, []

    def generate(self, prompts, max_tokens, temperature=1.0, **kw):
        assert temperature == 0.0 and max_tokens == judge.REPLY_TOKENS
        texts = [self.tok.decode(p) for p in prompts]
        self.prompts += texts
        return [(self.tok.encode(self.reply(t), add_special_tokens=False), []) for t in texts]


def test_ratings_parse_as_ragas_does():
    # the first digit of the scale, in the scale's order, anywhere in the reply; over the scale's maximum
    assert judge.rating("4", range(5)) == 1.0 and judge.rating("The rating is: 2", range(5)) == 0.5
    assert judge.rating("**0**", range(5)) == 0.0 and judge.rating("4 (or 2)", range(5)) == 0.5  # 2 before 4
    assert judge.rating("1 or 2", (2, 1, 0)) == 1.0 and judge.rating(" [1]", (2, 1, 0)) == 0.5
    assert judge.rating("not sure", (2, 1, 0)) is None and judge.rating("", range(5)) is None
    assert judge.mean_valid(1.0, 0.0) == 0.5 and judge.mean_valid(None, 0.5) == 0.5 and judge.mean_valid(None, None) is None


def test_each_metric_sends_its_two_prompts_and_keeps_ragas_shortcuts(tok):
    def reply(p):
        if "### User Answer: in Selstoa" in p:  # AnswerAccuracy's first prompt (the response first)
            return "4"
        return "Rating: 2" if "Reference Answer" in p else "1"
    eng = Replies(tok, reply)
    j = judge.Judge(eng, "scripted")
    assert j.accuracy([("Where was Ulla born?", "Selstoa", "in Selstoa")]) == [0.75]  # (4/4 + 2/4) / 2
    first, second = eng.prompts
    assert "### Question: Where was Ulla born?\n### User Answer: in Selstoa\n### Reference Answer: Selstoa" in first
    assert "Reference Answer: Selstoa\n\nUser Answer: in Selstoa\n\nRating: " in second  # the two swapped
    assert first.startswith("<|im_start|>") and "<|im_start|>user\nInstruction: You are a world class" in first
    n = len(eng.prompts)
    ctx = ["Ulla Brenmark was born in Selstoa."]
    assert j.relevance([("Where was Ulla born?", ctx), ("Where was Ulla born?", []), ("q", ["q"])]) == [0.5, 0.0, 0.0]
    assert len(eng.prompts) == n + 2  # the shortcuts ask nothing: no evidence, evidence that repeats the question
    assert "Analyzing Context and Question, the Relevance score is " in eng.prompts[n]
    assert "the Relevance score is  [" in eng.prompts[n + 1]  # template_relevance2, not the first twice
    assert j.groundedness([("Selstoa", ctx), ("Oslo", ctx), ("", ctx)]) == [1.0, 0.5, 0.0]  # verbatim: 1; empty: 0
    assert len(eng.prompts) == n + 4 and j.asked == n + 4


def test_the_cache_asks_nothing_twice_and_survives_a_kill(tok, tmp_path):
    cache = tmp_path / "judge.jsonl"
    items = [("Where was Ulla born?", "Selstoa", "Selstoa"), ("Who founded X?", "Ivo Lund", "Ulla")]
    eng = Replies(tok, lambda p: "4" if "User Answer: Selstoa" in p else "0")
    j = judge.Judge(eng, "scripted", cache)
    assert j.accuracy(items) == [1.0, 0.0] and j.asked == 4
    assert j.accuracy(items) == [1.0, 0.0] and j.asked == 4  # hits
    again = judge.Judge(Replies(tok, lambda p: pytest.fail("asked again")), "scripted", cache)  # a resumed run
    assert again.accuracy(items) == [1.0, 0.0] and again.asked == 0
    other = judge.Judge(eng, "another-judge", cache)  # the key holds the judge: another one's ratings are not reused
    other.accuracy(items[:1])
    assert other.asked == 2
    lines = cache.read_text().splitlines()
    cache.write_text("\n".join(lines[:-1]) + "\n" + lines[-1][:20])  # a kill mid-write: the cut line is asked again
    assert len(judge.load_cache(cache)) == len(lines) - 1
    cache.write_text(lines[0] + "\n{not json\n" + lines[1] + "\n")
    with pytest.raises(DataError, match=f"{cache}:2: not a judge cache line"):
        judge.load_cache(cache)


def test_an_edited_template_is_asked_again(tok, tmp_path, monkeypatch):
    # the key holds the template's text, not its place: an edited prompt never reuses the old prompt's ratings
    cache, items = tmp_path / "judge.jsonl", [("Where was Ulla born?", "Selstoa", "Selstoa")]
    eng = Replies(tok, lambda p: "4")
    assert judge.Judge(eng, "scripted", cache).accuracy(items) == [1.0] and len(eng.prompts) == 2
    edited = (judge.ACCURACY[0].replace("world class", "careful"), judge.ACCURACY[1])
    monkeypatch.setattr(judge, "ACCURACY", edited)
    again = judge.Judge(eng, "scripted", cache)
    assert again.accuracy(items) == [1.0] and again.asked == 1  # the edited one; the other from the cache
    assert "You are a careful state of the art" in eng.prompts[-1]


def test_the_judge_metric_and_its_agreement_with_em():
    def traj(answer, score):
        return dict(qid=answer, sample=0, question="q", answers=["Selstoa"], type="1hop", gold_steps=[], steps=[],
                    final_answer=answer, format_ok=True, judge=score)
    trajs = [traj("Selstoa", 1.0), traj("in Selstoa", 1.0), traj("Oslo", 0.0), traj("Oslo", 0.5)]
    m = metrics.metrics(trajs)
    assert m["judge"] == pytest.approx(62.5) and m["judge_n"] == 4  # (1 + 1 + 0 + 0.5) / 4
    assert m["judge_em_agree"] == pytest.approx(50.0)  # agree: Selstoa (both 1), Oslo 0.0 (both 0)
    assert "judge" not in metrics.metrics([dict(t, judge=None) for t in trajs])  # no judge: no column
    assert metrics.metrics(trajs[:2] + [dict(trajs[2], judge=None)])["judge_n"] == 2  # no rating parsed: left out
    json.dumps(m, allow_nan=False)


def test_the_judged_rag_reward_adds_its_weighted_ratings_to_the_outcome(tok):
    # --w_rag 2.0 1.0: 2 x ContextRelevance(question, evidence) + 1 x ResponseGroundedness(final answer, evidence) on
    # the outcome of each trajectory that parsed (steprewards.judge_rag, span_rewards)
    import steprewards
    eng = Replies(tok, lambda p: "2" if "Relevance score" in p else "1")  # relevance 2/2, groundedness 1/2
    w = steprewards.Weights(rag=(2.0, 1.0), judge=judge.Judge(eng, "scripted"))
    ev = ["Ulla Brenmark was born in Selstoa."]
    mk = lambda answer, ok=True, evidence=ev: dict(question="Where was Ulla born?", answers=["Selstoa"], final_answer=answer,
                                                   format_ok=ok, evidence=evidence, steps=[], gold_steps=[],
                                                   spans=[dict(kind="final", step=0)])
    xs = [mk("Selstoa, Uldoria"), mk("Selstoa"), mk(None, ok=False), mk("Oslo", evidence=[])]
    terms = steprewards.judge_rag(w, xs)
    # the first asked twice for each metric; the second is in its evidence verbatim (grounded, 1, unasked); the
    # failed one and its 0 ask nothing; no evidence: relevance 0 and groundedness 0, unasked
    assert [x["rag"] for x in xs] == [2 * 1.0 + 0.5, 2 * 1.0 + 1.0, 0.0, 0.0] and terms == [x["rag"] for x in xs]
    assert len(eng.prompts) == 2 + 2  # one relevance for the first two (the same inputs), groundedness of the first
    assert steprewards.span_rewards(xs[0], None, w)[1] == pytest.approx(1.0 + 2.5)  # F1-Recall 1 + its judged term
    assert steprewards.span_rewards(xs[2], None, w)[1] == 0.0
    eng.prompts.clear()
    steprewards.judge_rag(steprewards.Weights(rag=(2.0, 0.0), judge=w.judge), xs)  # Agentic RAG-R1's
    assert [x["rag"] for x in xs] == [2.0, 2.0, 0.0, 0.0] and not eng.prompts  # relevance alone, from the cache
