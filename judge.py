"""
judge.py: an LLM as a judge, through the engines (a local model folder in-process, the same model
on an OpenAI-compatible server token-exact, or any model behind a chat API by its name): the
judged RAG reward of Agentic RAG-R1 (stepgrpo.py --w_rag) and an LLM-judge metric (evaluate.py
--judge). The prompts and the scoring are ragas' NVIDIA metrics (src/ragas/metrics/_nv_metrics.py,
Apache-2.0). Agentic RAG-R1 calls ContextRelevance alone (its rag_reward); its correctness reward
and its evaluation judge are a yes/no prompt of its own, not AnswerAccuracy:
    accuracy(question, reference, response)  AnswerAccuracy: two prompts rate the response 0 / 2 / 4
                                             against the reference (the second with the two
                                             swapped), each / 4, averaged
    relevance(question, contexts)            ContextRelevance (Agentic RAG-R1's rag_reward): two
                                             prompts rate whether the evidence holds what the
                                             question needs, 0 / 1 / 2, each / 2, averaged
    groundedness(response, contexts)         ResponseGroundedness: two prompts rate how far the
                                             evidence supports the whole response, 0 / 1 / 2,
                                             each / 2, averaged (not ragas' Faithfulness,
                                             which counts the supported claims)
A rating is the first of the scale's digits found in the judge's reply (ragas' process_score); one
prompt with no rating leaves the other's; neither: None. ragas' own shortcuts are kept (empty
evidence: relevance 0; a response found verbatim in its evidence: grounded, 1), and so are its cuts
of the evidence, joined by newlines, to its first 4,192 characters for relevance and 8,192 for
groundedness (RELEVANCE_CHARS, GROUNDEDNESS_CHARS; the ragas source read, other versions cut
elsewhere or not at all): evidence past the cut is not judged. Deviations, each for
determinism or a stated bug: temperature 0 (ragas 0.1, with up to 5 retries of an unparsable reply:
at temperature 0 a retry returns the same reply, so there is one try), and ContextRelevance's second
prompt is its template_relevance2 (the ragas version read formats template_relevance1 twice). Every
rating is cached by the sha256 of (the judge model, the prompt template's text, its inputs) in a
JSONL file, so a rerun, a resumed run and the other arms ask the judge nothing twice, and an edited
template or another judge asks again.

    from judge import Judge
    j = Judge.load("models/Qwen2.5-72B-Instruct", url="http://localhost:8000/v1",
                   cache="out/judge.jsonl")               # token-exact: the folder's tokenizer
    j = Judge.load("gpt-4o", url="https://api.openai.com/v1", api_key=key)   # a chat API, by name
    j.accuracy([("Where was Ulla born?", "Selstoa", "in Selstoa")])      # -> [1.0]
"""
import hashlib
import json
from pathlib import Path

from dataio import DataError

# the evidence each metric reads, in characters (ragas' _nv_metrics.py cuts)
RELEVANCE_CHARS, GROUNDEDNESS_CHARS = 4192, 8192

# AnswerAccuracy's template_accuracy1 and template_accuracy2, verbatim (the missing spaces too)
ACCURACY = (
    "Instruction: You are a world class state of the art assistant for rating "
    "a User Answer given a Question. The Question is completely answered by the Reference Answer.\n"
    "Say 4, if User Answer is full contained and equivalent to Reference Answer"
    "in all terms, topics, numbers, metrics, dates and units.\n"
    "Say 2, if User Answer is partially contained and almost equivalent to Reference Answer"
    "in all terms, topics, numbers, metrics, dates and units.\n"
    "Say 0, if User Answer is not contained in Reference Answer or not accurate in all terms, "
    "topics,"
    "numbers, metrics, dates and units or the User Answer do not answer the question.\n"
    "Do not explain or justify your rating. Your rating must be only 4, 2 or 0 according to the "
    "instructions above.\n"
    "### Question: {query}\n"
    "### {answer0}: {sentence_inference}\n"
    "### {answer1}: {sentence_true}\n"
    "The rating is:\n",
    "I will rate the User Answer in comparison to the Reference Answer for a given Question.\n"
    "A rating of 4 indicates that the User Answer is entirely consistent with the Reference "
    "Answer, covering all aspects, topics, numbers, metrics, dates, and units.\n"
    "A rating of 2 signifies that the User Answer is mostly aligned with the Reference Answer, "
    "with minor discrepancies in some areas.\n"
    "A rating of 0 means that the User Answer is either inaccurate, incomplete, or unrelated to "
    "the Reference Answer, or it fails to address the Question.\n"
    "I will provide the rating without any explanation or justification, adhering to the following "
    "scale: 0 (no match), 2 (partial match), 4 (exact match).\n"
    "Do not explain or justify my rating. My rating must be only 4, 2 or 0 only.\n\n"
    "Question: {query}\n\n"
    "{answer0}: {sentence_inference}\n\n"
    "{answer1}: {sentence_true}\n\n"
    "Rating: ",
)
RELEVANCE = (  # ContextRelevance's template_relevance1 and template_relevance2, verbatim
    "### Instructions\n\n"
    "You are a world class expert designed to evaluate the relevance score of a Context"
    " in order to answer the Question.\n"
    "Your task is to determine if the Context contains proper information to answer the Question.\n"
    "Do not rely on your previous knowledge about the Question.\n"
    "Use only what is written in the Context and in the Question.\n"
    "Follow the instructions below:\n"
    "0. If the context does not contains any relevant information to answer the question, say 0.\n"
    "1. If the context partially contains relevant information to answer the question, say 1.\n"
    "2. If the context contains any relevant information to answer the question, say 2.\n"
    "You must provide the relevance score of 0, 1, or 2, nothing else.\nDo not explain.\n"
    "### Question: {query}\n\n"
    "### Context: {context}\n\n"
    "Do not try to explain.\n"
    "Analyzing Context and Question, the Relevance score is ",
    "As a specially designed expert to assess the relevance score of a given Context in relation "
    "to a Question, my task is to determine the extent to which the Context provides information "
    "necessary to answer the Question. I will rely solely on the information provided in the "
    "Context and Question, and not on any prior knowledge.\n\n"
    "Here are the instructions I will follow:\n"
    "* If the Context does not contain any relevant information to answer the Question, I will "
    "respond with a relevance score of 0.\n"
    "* If the Context partially contains relevant information to answer the Question, I will "
    "respond with a relevance score of 1.\n"
    "* If the Context contains any relevant information to answer the Question, I will respond "
    "with a relevance score of 2.\n\n"
    "### Question: {query}\n\n"
    "### Context: {context}\n\n"
    "Do not try to explain.\n"
    "Based on the provided Question and Context, the Relevance score is  [",
)
# ResponseGroundedness's template_groundedness1 and template_groundedness2, verbatim
GROUNDEDNESS = (
    "### Instruction\n\n"
    "You are a world class expert designed to evaluate the groundedness of an assertion.\n"
    "You will be provided with an assertion and a context.\n"
    "Your task is to determine if the assertion is supported by the context.\n"
    "Follow the instructions below:\n"
    "A. If there is no context or no assertion or context is empty or assertion is empty, say 0.\n"
    "B. If the assertion is not supported by the context, say 0.\n"
    "C. If the assertion is partially supported by the context, say 1.\n"
    "D. If the assertion is fully supported by the context, say 2.\n"
    "You must provide a rating of 0, 1, or 2, nothing else.\n\n"
    "### Context:\n"
    "<{context}>\n\n"
    "### Assertion:\n"
    "<{response}>\n\n"
    "Analyzing Context and Response, the Groundedness score is ",
    "As a specialist in assessing the strength of connections between statements and their given "
    "contexts, I will evaluate the level of support an assertion receives from the provided "
    "context. Follow these guidelines:\n\n"
    "* If the assertion is not supported or context is empty or assertion is empty, assign a "
    "score of 0.\n"
    "* If the assertion is partially supported, assign a score of 1.\n"
    "* If the assertion is fully supported, assign a score of 2.\n\n"
    "I will provide a rating of 0, 1, or 2, without any additional information.\n\n"
    "---\n**Context:**\n[{context}]\n\n"
    "**Assertion:**\n[{response}]\n\n"
    "Do not explain."
    "Based on the provided context and response, the Groundedness score is:",
)
REPLY_TOKENS = 8  # a rating is a digit; a few tokens leave room for the judge's "**" or "[" first

def rating(reply, scale):
    """ragas' process_score: the first digit of `scale` (in its order) found anywhere in the reply,
    over its maximum; None when none is there."""
    for i in scale:
        if str(i) in reply:
            return i / max(scale)
    return None

def mean_valid(a, b):
    """ragas' average_scores as its docstring says: the mean of the two ratings, the one that
    parsed, or None."""
    ok = [s for s in (a, b) if s is not None]
    return sum(ok) / len(ok) if ok else None

class Judge:
    """Ratings from a judge engine (engines.make_engine: each prompt one user turn, rendered by its
    tokenizer or sent as a chat message), cached in `cache` (a JSONL file, or None)."""
    def __init__(self, engine, name, cache=None):
        self.engine, self.name, self.cache, self.cache_path = engine, name, {}, None
        self.asked = 0  # prompts sent to the judge (not answered from the cache)
        if cache:
            self.use_cache(cache)

    def use_cache(self, path):
        """Ratings from now on are read from and written to the JSONL file `path` (those already
        read are kept)."""
        self.cache_path = Path(path)
        self.cache.update(load_cache(self.cache_path))

    @classmethod
    def load(cls, model, url=None, api_key=None, cache=None, backend=None, **engine_kw):
        """A judge: a model folder in-process (vLLM); with url a served one, token-exact
        (backend openai: the folder gives the tokenizer and chat template, as evaluate.py
        --backend openai) where `model` is a folder, else through the chat API (backend chat:
        `model` is the served model's name, no local folder needed). backend: force one of the
        two. api_key: the server's."""
        import engines
        backend = backend or ("vllm" if not url else "openai" if Path(model).is_dir()
                              else "chat")
        if backend == "chat":
            engine = engines.make_engine("chat", None, base_url=url, api_key=api_key,
                                         served=model, **engine_kw)
            return cls(engine, engine.name, cache)
        # beside the policy's engine (half of a GPU): a 72B judge belongs on a server of its own
        if not url:
            engine_kw["gpu_memory_utilization"] = 0.3
        engine = engines.make_engine(backend, model, base_url=url, api_key=api_key, **engine_kw)
        # the judge model: the served one's name, or the folder's absolute path (the base name
        # alone is "final" for every run's checkpoint)
        return cls(engine, getattr(engine, "name", None) or str(Path(model).resolve()), cache)

    def accuracy(self, items):
        """items: (question, reference, response) -> AnswerAccuracy in [0, 1] (None: no rating
        parsed)."""
        fields = [[dict(query=q, answer0="User Answer", answer1="Reference Answer",
                        sentence_inference=r, sentence_true=ref),
                   dict(query=q, answer0="Reference Answer", answer1="User Answer",
                        sentence_inference=ref, sentence_true=r)]
                  for q, ref, r in items]
        return self.rate("accuracy", ACCURACY, fields, range(5), [None] * len(items))

    def relevance(self, items):
        """items: (question, [context passages]) -> ContextRelevance in [0, 1]."""
        fixed = []
        # ragas' shortcuts: no evidence, or evidence that only repeats the question
        for q, ctx in items:
            c = "\n".join(ctx).strip()
            fixed.append(0.0 if not q.strip() or not c or c == q.strip() or c in q.strip()
                         else None)
        fields = [[dict(query=q, context="\n".join(ctx)[:RELEVANCE_CHARS])] * 2 for q, ctx in items]
        return self.rate("relevance", RELEVANCE, fields, (2, 1, 0), fixed)

    def groundedness(self, items):
        """items: (response, [context passages]) -> ResponseGroundedness in [0, 1] (the whole
        response's support in the evidence)."""
        fixed = []
        # ragas' shortcuts: nothing to judge (0); the response found in its evidence (1)
        for r, ctx in items:
            c = "\n".join(ctx).strip()
            fixed.append(0.0 if not r.strip() or not c else 1.0 if r.strip() in c else None)
        fields = [[dict(context="\n".join(ctx)[:GROUNDEDNESS_CHARS], response=r)] * 2
                  for r, ctx in items]
        return self.rate("groundedness", GROUNDEDNESS, fields, (2, 1, 0), fixed)

    def rate(self, metric, templates, fields, scale, fixed):
        """Each item's two prompts (templates[k] filled with fields[i][k]) rated by the judge at
        temperature 0, or read from the cache; the item's score is mean_valid of the two (fixed[i]
        where it is not None). metric: what is rated (the key holds its template's text)."""
        keys = [[self.key(templates[k], f) for k, f in enumerate(two)] for two in fields]
        todo = {}  # key -> prompt, for what the cache does not hold (each distinct prompt once)
        for i, (two, ks) in enumerate(zip(fields, keys)):
            if fixed[i] is None:
                todo.update({key: templates[k].format(**f)
                             for k, (f, key) in enumerate(zip(two, ks)) if key not in self.cache})
        if todo:
            replies = self.replies(list(todo.values()))
            self.asked += len(todo)
            for key, reply in zip(todo, replies):
                self.remember(key, rating(reply, scale))
        return [fixed[i] if fixed[i] is not None else mean_valid(*(self.cache[k] for k in ks))
                for i, ks in enumerate(keys)]

    def replies(self, prompts):
        """The judge's reply to each prompt, sent as one user turn at temperature 0: a chat API
        takes the message, another engine its tokenizer's rendering of it."""
        user = [[dict(role="user", content=p)] for p in prompts]
        if hasattr(self.engine, "texts"):  # remote.ChatEngine
            return self.engine.texts(user, REPLY_TOKENS, temperature=0.0)
        tok = self.engine.tok
        ids = [tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True) for m in user]
        outs = self.engine.generate([list(getattr(x, "input_ids", x)) for x in ids],
                                    REPLY_TOKENS, temperature=0.0)
        return [tok.decode(out, skip_special_tokens=True) for out, _ in outs]

    def key(self, template, f):
        """The cache key: the sha256 of the judge model, the template's text and its inputs, so an
        edited prompt or another judge asks again."""
        return hashlib.sha256(json.dumps([self.name, template, f],
                                         sort_keys=True).encode()).hexdigest()

    def remember(self, key, score):
        self.cache[key] = score
        if self.cache_path:
            self.cache_path.parent.mkdir(parents=True, exist_ok=True)
            # one line a rating, written whole: a kill loses that line at most
            with open(self.cache_path, "a") as f:
                f.write(json.dumps(dict(key=key, score=score)) + "\n")

def load_cache(path):
    """A judge cache file -> {key: score}. A last line cut short (a run killed mid-write) is dropped
    and asked again; any other bad line is an error naming it."""
    if not path.is_file():
        return {}
    lines, cache = path.read_text().split("\n"), {}
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            cache[row["key"]] = row["score"]
        except (json.JSONDecodeError, KeyError, TypeError):
            if n == len(lines):  # no newline after it: the write a kill interrupted
                break
            raise DataError(f"{path}:{n}: not a judge cache line ({line[:80]!r})") from None
    return cache
