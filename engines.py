"""
engines.py: the generation engines and their weight sync. An engine has submit(key, prompt, ...) +
poll() -> [(key, token ids, logprobs)] of the requests that finished, generate(prompts) -> [(token
ids, logprobs)] on top, sleep() and sync_weights(weights), which checks that every parameter came.
Outputs stop after the first stop string or EOS; logprobs are those of the distribution sampled from
(logits / temperature), as the trainer computes them.
    VLLMEngine  vLLM in-process (continuous batching; weights reloaded in place after each update)
    HFEngine    plain transformers generate (the fallback, and the reference the vLLM path is
                tested against)
A served model's engines (OpenAIEngine, ChatEngine: a server's completions or chat API) are in
remote.py; make_engine builds any of the four. A new engine goes into one of the two and into
make_engine.
"""
import contextlib
import gc
import logging
import os
import sys
from pathlib import Path

import psutil
import torch

from transcript import truncate
from vision import VisionIO

MAX_LEN = 4096  # tokens of a request (prompt + new) that the engines take in training by default
CPU_BLOCK = 32  # tokens a KV block holds on the CPU (vLLM's CPU attention: a multiple of 32)
CPU_KV_TOKENS = 90_000  # the CPU engine's KV cache, in tokens: 100 trajectories x 800 tokens, with
                        # room (SmolLM2: 3.9 GiB)
# vLLM's INFO lines drown the scripts' own; set it to see them
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

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

@contextlib.contextmanager
def heap_kept_frozen(keep):
    """vLLM freezes the whole heap once its engine has started (gc.freeze: no collection scans it
    again), and its shutdown unfreezes it and collects it whole, twice: ~1.5 s of CPU an engine,
    paid again by every engine of a process (a test process's, a script's arms one after another).
    keep: vLLM's freezes and unfreezes are skipped inside the block, so the heap VLLMEngine froze
    before the engine stays frozen, the engine's own objects stay collectable, and the shutdown's
    collections scan them alone. On the CPU only: on a GPU vLLM's freeze also keeps the collector
    off the objects its CUDA graph capture needs (vllm/utils/gc_utils.py)."""
    freeze, unfreeze = gc.freeze, gc.unfreeze
    if keep:
        gc.freeze = gc.unfreeze = lambda: None
    try:
        yield
    finally:
        gc.freeze, gc.unfreeze = freeze, unfreeze

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
        expansions and for vLLM's. kv_tokens: the CPU's KV cache, in tokens, at least one request of
        max_model_len (max_model_len + CPU_BLOCK: vLLM keeps a block out of use). device: the
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
        kv_tokens = max(kv_tokens, max_model_len + CPU_BLOCK)  # at least one whole request
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
        # trainer's model) first makes each of those passes skip it. On the CPU that stays the
        # frozen heap (heap_kept_frozen: the engine's own objects are left collectable)
        gc.collect()
        gc.freeze()
        self.keep_heap = on_cpu
        rss = psutil.Process().memory_info().rss  # what the process grows by as it starts: held()
        with heap_kept_frozen(self.keep_heap):
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
        self.grew = psutil.Process().memory_info().rss - rss
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(
            quiet_rotary)
        self.params = param_names(model)  # what every sync must send (check_sent)
        self.tok = self.llm.get_tokenizer()
        # prompt + new tokens; rollout() ends a longer trajectory instead of submitting it
        self.max_len = max_model_len
        self.pending, self.n_requests = {}, 0  # vLLM request id -> (caller's key, stop strings)
        # tokens the model actually ran (prompt tokens not in the prefix cache)
        self.computed = dict(prefill=0, decode=0)
        # the in-process engine core (VLLM_ENABLE_V1_MULTIPROCESSING=0): its KV blocks' use
        self.core = getattr(self.llm.llm_engine.engine_core, "engine_core", None)
        self.kv_manager = self.core.scheduler.kv_cache_manager if self.core else None
        self.kv_peak = 0.0  # the highest share of the KV cache in use since kv_used()

    def kv_used(self):
        """The highest share of the KV cache's blocks in use at once since the last call (1.0: it
        was full, so requests waited or were recomputed), None where the scheduler is in another
        process."""
        peak, self.kv_peak = self.kv_peak, 0.0
        return round(peak, 4) if self.kv_manager else None

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
            outs = engine.step()
            if self.kv_manager:
                self.kv_peak = max(self.kv_peak, self.kv_manager.usage)
            for o in outs:
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

    def held(self):
        """{part: bytes} of this process's memory the engine holds: its KV cache, counted off its
        tensors, and the rest of what the process grew by as the engine started (vllm-cpu packs
        the linear layers' weights out of the tensors it shows; its buffers; 0 if the process
        grew less, reusing memory it had freed) ({} where the engine runs in another process)."""
        if self.core is None:
            return {}
        runner = self.core.model_executor.driver_worker.worker.model_runner
        kv = sum(t.numel() * t.element_size() for t in runner.kv_caches)
        return {"engine (weights, buffers)": max(0, self.grew - kv), "KV cache": kv}

    def close(self):
        """Shut the engine down now. NB: vLLM's teardown also destroys torch.distributed's default
        process group."""
        with heap_kept_frozen(self.keep_heap):
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

    def held(self):
        """{part: bytes}: the engine's weights (generate's cache lives only inside a call)."""
        return {"engine weights": sum(p.numel() * p.element_size()
                                      for p in self.model.parameters())}

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

def make_engine(backend, model, max_images=16, base_url=None, api_key=None, served=None,
                max_concurrency=8, timeout=None, kv_tokens=CPU_KV_TOKENS, **kw):
    """backend vllm | hf | openai | chat; kw: the settings the engines take (dtype, seed,
    max_model_len, max_pixels, device); max_images, kv_tokens: a vLLM engine's pictures a prompt
    (rollout.Settings.max_images; HF takes any number) and CPU KV cache; base_url, api_key, served,
    max_concurrency, timeout: a served model's (remote.py): its server, key, name there (None: the
    one /v1/models lists), requests in flight and seconds a try (None: remote.REQUEST_TIMEOUT)."""
    if backend in ("openai", "chat"):
        import remote
        if not base_url:
            sys.exit(f"error: --backend {backend} needs --base_url (e.g. http://localhost:8000/v1)")
        engine = remote.OpenAIEngine if backend == "openai" else remote.ChatEngine
        extra = dict(max_pixels=kw.get("max_pixels")) if backend == "chat" else {}
        return engine(model, base_url, served=served, api_key=api_key,
                      timeout=timeout or remote.REQUEST_TIMEOUT, max_concurrency=max_concurrency,
                      seed=kw.get("seed") or 0, max_model_len=kw.get("max_model_len") or MAX_LEN,
                      **extra)
    return (VLLMEngine(model, max_images=max_images, kv_tokens=kv_tokens, **kw) if backend == "vllm"
            else HFEngine(model, **kw))
