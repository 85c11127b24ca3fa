"""
remote.py: the engines of a served model (the step loop, a teacher or a judge against a server),
each through one client of the openai package, built in one place (client):
    OpenAIEngine  /v1/completions of a server that takes and returns token ids (vLLM's, SGLang's):
                  the in-process engine's transcript, token for token
    ChatEngine    /v1/chat/completions of any OpenAI-compatible API (a hosted model, a VL model
                  behind a chat-only gateway): not token-exact
Both have the engines' interface (engines.py): submit(key, prompt, ...) + poll(), generate(prompts),
sleep() and close(); a weight sync is refused. Requests run concurrently (at most max_concurrency
in flight) over the client's kept-open connections. What a request retries is the openai client's
policy: a refused, reset or dropped connection, a timeout, 408, 409, 429 and 5xx, `tries` tries in
all, each after the server's retry-after-ms or Retry-After (up to 2 minutes; a longer one is not
waited for) or a jittered back-off doubling from 0.5 s to 8 s; after the last, or at once on another
4xx or a reply that is not JSON, one line names the server and what it answered.
"""
import functools
import os
import sys
import zlib
from pathlib import Path

from transcript import truncate
from vision import VisionIO

API_KEY_ENV, JUDGE_KEY_ENV = "OPENAI_API_KEY", "JUDGE_API_KEY"  # a server's key, a judge's
REQUEST_TIMEOUT = 300  # seconds a try of a request may take (a hosted model under load, long
                       # prompts)
TRIES = 6  # tries of a request in all
# what the openai package takes from the environment for each argument left unset (the key, the
# organisation, the project, headers, the URL): the client is built without them, or one server's
# key would go to another
OPENAI_ENV = ("OPENAI_API_KEY", "OPENAI_ADMIN_KEY", "OPENAI_ORG_ID", "OPENAI_PROJECT_ID",
              "OPENAI_BASE_URL", "OPENAI_CUSTOM_HEADERS", "OPENAI_WEBHOOK_SECRET")
NO_KEY = "EMPTY"  # the key a keyless server is sent (the openai client sends one; vLLM's docs')

def client(base_url, key, timeout, tries):
    """The openai client of the server at base_url: `key` (None: the server takes none) in its
    Authorization header only, nothing read from the environment (its OPENAI_* variables are
    hidden while the client is built), each request tried `tries` times in all, `timeout` seconds
    a try."""
    import openai
    hidden = {k: os.environ.pop(k) for k in OPENAI_ENV if k in os.environ}
    try:
        return openai.OpenAI(base_url=base_url, api_key=key or NO_KEY, timeout=timeout,
                             max_retries=tries - 1)
    finally:
        os.environ.update(hidden)

def api_key(flag, env=API_KEY_ENV):
    """The key a server wants: the flag's value, else the environment variable `env` (which keeps
    it out of the process list), else None. Scripts drop it from what they write (without_keys)."""
    return flag or os.environ.get(env) or None

def without_keys(flags):
    """A script's flags {name: value} without the API keys: what a run's config, log and
    signature may hold."""
    return {k: v for k, v in flags.items() if not k.endswith("api_key")}

class Served:
    """What both served engines share: the client, the requests in flight on a thread pool, submit
    and poll over them (each request's seed made from the engine's and its key, so a rerun asks
    the same whatever the order of replies), generate on top, and the one-line failure. A subclass
    gives complete(prompt, images, max_tokens, temperature, top_p, stop, top_k, seed) -> (token
    ids, logprobs) of one request, run on the pool."""
    dtype = "remote"

    def __init__(self, base_url, api_key=None, timeout=REQUEST_TIMEOUT, max_concurrency=8, seed=0,
                 max_model_len=None, tries=TRIES):
        from concurrent.futures import ThreadPoolExecutor
        if max_concurrency < 1:
            sys.exit(f"error: --max_concurrency {max_concurrency}: at least 1")
        self.url, self.key, self.tries = base_url.rstrip("/"), api_key, tries
        self.client = client(self.url, api_key, timeout, tries)
        self.pool = ThreadPoolExecutor(max_concurrency)
        self.pending, self.n_requests, self.seed, self.max_len = {}, 0, seed, max_model_len

    def fail(self, what):
        """End with one line naming the server (from a request's thread: the caller's poll
        raises it), the key never in it."""
        line = " ".join(f"error: the server {self.url} {what}".split())
        raise SystemExit(line.replace(self.key, "<key>") if self.key else line)

    def call(self, path, body=None):
        """GET (body None) or POST JSON to the server: its JSON reply, after the client's tries."""
        import openai
        try:
            out = (self.client.get(path, cast_to=object) if body is None
                   else self.client.post(path, body=body, cast_to=object))
        except openai.APIStatusError as e:  # a 4xx but 408, 409, 429, or the last try's answer
            retried = e.status_code in (408, 409, 429) or e.status_code >= 500
            self.fail(f"did not answer {path} after {self.tries} tries (HTTP {e.status_code}: "
                      f"{e.response.text[:300]})" if retried else
                      f"refused {path} ({e.status_code}): {e.response.text[:300]}")
        except openai.APIConnectionError as e:  # refused, reset, cut short, timed out: every try
            self.fail(f"did not answer {path} after {self.tries} tries "
                      f"({e.__cause__ or e.message})")
        except ValueError:  # a reply that says it is JSON and is not
            out = None
        if not isinstance(out, dict):
            self.fail(f"answered {path} with something that is not JSON: {str(out)[:100]!r}")
        return out

    def served_model(self):
        """The model /v1/models lists, when it lists one (else the name must be given)."""
        ids = [m.get("id") for m in self.call("/models").get("data") or []]
        if len(ids) != 1:
            self.fail(f"serves {len(ids)} models ({', '.join(map(str, ids[:5]))}): name one "
                      "(evaluate.py --served_model, synth.py --teacher, --judge)")
        return ids[0]

    def submit(self, key, prompt, max_tokens, temperature=1.0, top_p=1.0, stop=(), top_k=0,
               images=(), seed=None):
        """Send one step-loop request (prompt: transcript ids); it runs beside the others in
        flight. seed: the base of its seed (None: the engine's)."""
        self.check_prompt(images)
        seed = zlib.crc32(repr((self.seed if seed is None else seed, key)).encode())
        self.n_requests += 1
        future = self.pool.submit(self.complete, prompt, images, max_tokens, temperature, top_p,
                                  stop, top_k, seed)
        self.pending[future] = (self.n_requests, key)

    def check_prompt(self, images):
        """Exit in one line on a prompt this engine cannot send (OpenAIEngine: pictures)."""

    def poll(self):
        """Wait until at least one request is answered; those, [(key, ids, logprobs)] in the order
        sent (empty when nothing is in flight)."""
        from concurrent.futures import FIRST_COMPLETED, wait
        if not self.pending:
            return []
        done, _ = wait(self.pending, return_when=FIRST_COMPLETED)
        return [(self.pending.pop(f)[1], *f.result())
                for f in sorted(done, key=lambda f: self.pending[f][0])]

    def generate(self, prompts, max_tokens, temperature=1.0, top_p=1.0, stop=(), seed=None,
                 top_k=0, images=None, keys=None):
        """keys: the requests' keys (their seeds; default the prompts' indexes)."""
        keys = keys or list(range(len(prompts)))
        for i, p in enumerate(prompts):
            self.submit((i, keys[i]), p, max_tokens, temperature, top_p, stop, top_k,
                        images[i] if images else (), seed)
        res = {}
        while len(res) < len(prompts):
            res.update((k[0], (ids, lps)) for k, ids, lps in self.poll())
        return [res[i] for i in range(len(prompts))]

    def sleep(self):
        pass

    def close(self):
        """Requests not yet sent are dropped; those in flight end at their timeout."""
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.client.close()

    def sync_weights(self, weights):
        sys.exit(f"error: --backend {self.backend}: a served model cannot take new weights "
                 "(training, several --model)")

class OpenAIEngine(Served):
    """The step loop against an OpenAI-compatible completions server. The prompt goes as token ids
    (vLLM's and SGLang's /v1/completions take them), so the transcript is exactly the local one, and
    the completion comes back as token ids (vLLM's return_token_ids; a server without them: the text
    re-encoded, not token-exact) with the sampled tokens' logprobs where the server returns them.
    The local model folder gives the tokenizer and chat format (nothing downloads); the server's
    model is `served` or the one /v1/models lists. A VL prompt and a weight sync are refused."""
    backend, vis = "openai", None

    def __init__(self, model, base_url, served=None, **kw):
        from transformers import AutoTokenizer
        if VisionIO.load(model) is not None:
            sys.exit(f"error: --backend openai: {model} is a VL policy; its pictures would need "
                     "the chat endpoint, which is not token-exact: score it in-process")
        super().__init__(base_url, **kw)
        self.tok = AutoTokenizer.from_pretrained(model)
        self.name = served or self.served_model()
        self.mode = f"token-exact: {self.name} at {self.url}/completions (token ids in and out)"

    def check_prompt(self, images):
        if images:
            sys.exit("error: --backend openai: a prompt holds pictures (a VL trajectory): score it "
                     "in-process")

    def complete(self, prompt, images, max_tokens, temperature, top_p, stop, top_k, seed):
        """One completion of the token ids `prompt` -> (ids, logprobs), cut as engines cut."""
        body = dict(model=self.name, prompt=list(prompt), max_tokens=max_tokens,
                    temperature=temperature, top_p=top_p, stop=list(stop) or None, logprobs=0,
                    return_token_ids=True, include_stop_str_in_output=True,
                    **({"top_k": top_k} if top_k else {}),
                    **({"seed": seed} if temperature > 0 else {}))
        out = self.call("/completions", body)
        try:
            c = out["choices"][0]
            ids = c.get("token_ids") or self.tok.encode(c["text"], add_special_tokens=False)
            lps = [lp or 0.0 for lp in ((c.get("logprobs") or {}).get("token_logprobs")
                                        or [0.0] * len(ids))]
        except (KeyError, IndexError, TypeError, AttributeError):
            self.fail(f"answered /completions without choices[0].text: {str(out)[:200]}")
        return truncate(self.tok, list(ids), lps[:len(ids)], stop, self.tok.eos_token_id)

class ChatEngine(Served):
    """The step loop, a teacher or a judge against any OpenAI-compatible chat API
    (/v1/chat/completions). A prompt (transcript ids, as every caller hands one) goes as chat
    messages read back from the ids by the local policy's template (transcript.ChatTurns), its
    pictures as image_url parts with data URLs; the server renders them with its own chat template;
    the reply's text is re-encoded with the local tokenizer for the transcript's bookkeeping. Not
    token-exact: the server's template and tokenizer may differ from the policy's, and a reply's
    tokens are the canonical encoding of its text, not the tokens sampled; logprobs are 0.0 (the
    server's tokens are not the local ones); the token-exact mode is OpenAIEngine. A stop string the
    server cut off is put back, and a reply that ended its turn gets the end-of-turn token, as an
    in-process engine writes them (reply). model None (a judge): no local tokenizer, prompts are
    messages (texts)."""
    backend = "chat"

    def __init__(self, model, base_url, served=None, max_pixels=None, **kw):
        from transcript import ChatTurns
        super().__init__(base_url, **kw)
        self.tok = self.vis = self.turns = None
        if model is not None:  # the local policy: its tokenizer, chat format and processor
            from transformers import AutoTokenizer
            self.tok, self.vis = AutoTokenizer.from_pretrained(model), VisionIO.load(model,
                                                                                     max_pixels)
            self.turns = ChatTurns(self.tok)
        self.name = served or self.served_model()
        self.mode = (f"chat: {self.name} at {self.url}/chat/completions (the server's chat "
                     "template; replies re-encoded with the local tokenizer: not token-exact)")

    def ask(self, messages, max_tokens, temperature, top_p=1.0, stop=(), top_k=0, seed=None,
            go_on=False):
        """One chat request -> (the reply's text, the server's choice); stop strings the local
        tokenizer's own special tokens (its end of turn) are not sent: another model's tokenizer
        does not know them, and a server ends a turn by itself."""
        specials = self.turns.fmt.specials if self.turns else None
        stops = [s for s in stop if not (specials and specials.fullmatch(s))]
        body = dict(model=self.name, messages=messages, max_tokens=max_tokens,
                    temperature=temperature, top_p=top_p, **({"stop": stops} if stops else {}),
                    # top-k is not OpenAI's: an API that refuses it needs top-k 0 (synth.py)
                    **({"top_k": top_k} if top_k else {}),
                    **({"seed": seed} if seed is not None and temperature > 0 else {}))
        if go_on:  # the last assistant message continued (IRCoT's sentences): vLLM's extension
            body.update(continue_final_message=True, add_generation_prompt=False)
        out = self.call("/chat/completions", body)
        try:
            choice = out["choices"][0]
            return choice["message"].get("content") or "", choice
        except (KeyError, IndexError, TypeError, AttributeError):
            self.fail(f"answered /chat/completions without choices[0].message: {str(out)[:200]}")

    def texts(self, conversations, max_tokens, temperature=0.0):
        """The reply texts of several message lists, concurrently (the judge's prompts)."""
        futures = [self.pool.submit(self.ask, m, max_tokens, temperature) for m in conversations]
        return [f.result()[0] for f in futures]

    def complete(self, prompt, images, max_tokens, temperature, top_p, stop, top_k, seed):
        """One step-loop request: the prompt's chat, the reply's ids as an in-process engine's."""
        messages, go_on = self.messages(prompt, images)
        ids = self.reply(*self.ask(messages, max_tokens, temperature, top_p, stop, top_k, seed,
                                   go_on), stop)
        return truncate(self.tok, ids, [0.0] * len(ids), stop, self.tok.eos_token_id)

    def messages(self, prompt, images=()):
        """(OpenAI's messages of a prompt's ids, whether the last one is continued): ChatTurns',
        pictures as image_url parts."""
        messages, go_on = self.turns.messages(prompt, images)
        return [dict(m, content=[image_url(p) for p in m["content"]])
                if isinstance(m["content"], list) else m for m in messages], go_on

    def reply(self, text, choice, stop):
        """A reply's token ids as an in-process engine writes the turn: the stop string the
        server cut off put back (vLLM's stop_reason or SGLang's matched_stop names it; a server
        that names none, OpenAI's: the stop tag the text left open), the end-of-turn token after
        a reply that ended by itself."""
        ended = choice.get("finish_reason") == "stop" and not any(s in text for s in stop)
        matched = choice.get("stop_reason", choice.get("matched_stop"))
        if ended and not ("stop_reason" in choice or "matched_stop" in choice):
            matched = next((s for s in stop if s.startswith("</")
                            and text.rfind("<" + s[2:]) > text.rfind(s)), None)
        if ended and isinstance(matched, str) and matched in stop:
            text, ended = text + matched, False
        return self.turns.reply_ids(text) + [self.tok.eos_token_id] * ended

@functools.lru_cache(maxsize=64)
def data_url(path):
    """A picture file as a data: URL (its type from its name; PNG where unknown)."""
    import base64
    import mimetypes
    kind = mimetypes.guess_type(str(path))[0] or "image/png"
    return f"data:{kind};base64,{base64.b64encode(Path(path).read_bytes()).decode()}"

def image_url(part):
    """A ChatTurns part as OpenAI's: a picture as an image_url part with its data URL."""
    if part["type"] != "image":
        return part
    return dict(type="image_url", image_url=dict(url=data_url(part["path"])))
