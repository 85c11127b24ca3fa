"""rollout.py: the step loop on both backends, masks and spans, malformed outputs, weight sync into vLLM; and
baselines.py (single-shot RAG, IterRetGen, IRCoT).

The policy is a tiny random Llama (conftest.py: SmolLM2's tokenizer cut to 4,096 ids; head_dim 32: vLLM's CPU
attention rejects 16); GoldPolicy (the gold decomposition written through the real loop and real retrieval) is the
known-good policy."""
import copy
import io

import pytest
import torch

import baselines
import dataio
import engines
import prepare
import prompts
import retrievers
import reward
import rollout

@pytest.fixture(scope="module")
def tiny_model(tiny_model_dir):
    return tiny_model_dir

@pytest.fixture(scope="module")
def vllm_engine(tiny_model):
    return engines.VLLMEngine(tiny_model, max_model_len=4096)

@pytest.fixture(scope="module")
def hf_engine(tiny_model):
    return engines.HFEngine(tiny_model)

@pytest.fixture(scope="module")
def retriever(tiny_index):
    return retrievers.Retriever(tiny_index, "bm25")

def test_a_cpu_engine_leaves_its_objects_to_the_collector_and_the_heap_before_it_frozen(tiny_model):
    # vLLM freezes the whole heap once its engine has started, and its shutdown unfreezes it and collects it whole,
    # twice (~2 s an engine); on the CPU the heap frozen before the engine stays frozen through the shutdown, and the
    # engine's own objects are never frozen (the collector can free them). First in the file: a closed engine takes
    # vLLM's process-wide state down with it, which the module's engine (vllm_engine) needs
    import gc
    freeze, unfreeze = gc.freeze, gc.unfreeze
    engine = engines.VLLMEngine(tiny_model, max_model_len=1024)
    runner = engine.core.model_executor.driver_worker.worker.model_runner
    assert any(o is runner for o in gc.get_objects())  # gc.get_objects() leaves the frozen ones out
    frozen = gc.get_freeze_count()
    engine.close()
    assert frozen > 100_000 and gc.get_freeze_count() > 0.9 * frozen
    assert (gc.freeze, gc.unfreeze) == (freeze, unfreeze)  # the collector's own again, for the rest of the process

def test_the_cpu_engines_kv_cache_is_sized_in_tokens(tiny_model, vllm_engine):
    # keys and values of every layer: SmolLM2-135M 2 x 30 layers x 3 KV heads x 64 x 4 bytes (fp32), the tiny Llama
    # 2 x 2 x 1 x 32 x 4; the engine's cache holds CPU_KV_TOKENS of them whatever the model (a tiny one zeroes MBs at
    # start, not GiBs)
    assert engines.kv_bytes_per_token(prepare.DEFAULT_MODEL, "float32") == 46_080
    assert engines.kv_bytes_per_token(prepare.DEFAULT_MODEL, "bfloat16") == 23_040
    assert engines.kv_bytes_per_token(tiny_model, "float32") == 512
    cache = vllm_engine.llm.llm_engine.vllm_config.cache_config
    assert cache.kv_cache_memory_bytes == engines.CPU_KV_TOKENS * 512
    assert engines.CPU_KV_TOKENS - cache.block_size < cache.num_gpu_blocks * cache.block_size <= engines.CPU_KV_TOKENS

def test_the_golden_routing_think_names_no_kb_before_the_sub_question(tiny_index, retriever, hf_engine):
    # the gold steps' KBs and answers; the routing <think> names no retriever, so the choice is made at <ret>, after
    # the sub-question is written
    tok, qs = hf_engine.tok, dataio.load_questions(tiny_index, "train")[:20]
    golds = rollout.rollout(rollout.GoldPolicy(tok, qs), retriever, qs)
    assert all(x["format_ok"] for x in golds)
    assert [[(st["kb"], st["answer"]) for st in x["steps"]] for x in golds] == \
        [[(st["kb"], st["answer"]) for st in q["steps"]] for q in qs]
    for x in golds:
        for a in x["spans"]:
            if a["kind"] == "route" and a["step"] < len(x["gold_steps"]):
                think = tok.decode(x["ids"][a["start"]:a["end"]]).split("</think>")[0]
                assert think == "<think>" + rollout.GoldPolicy.THINK
    # golden prefixes are written the same way (Step-GRPO's teacher_prefix groups start from them)
    _, prefixes = rollout.golden_prefixes(tok, retriever, qs[:4])
    assert all("retriever." not in tok.decode(p) for _, _, p, _ in prefixes)

def test_gold_policy_through_the_loop_builds_exact_masks_and_spans(tiny_index, retriever, hf_engine):
    tok = hf_engine.tok
    qs = dataio.load_questions(tiny_index, "train")[:30]
    trajs = rollout.rollout(rollout.GoldPolicy(tok, qs), retriever, qs, n=1)
    assert len(trajs) == 30 and all(x["format_ok"] for x in trajs)
    for q, x in zip(qs, trajs):
        assert x["final_answer"] == q["answers"][0]
        assert [s["kb"] for s in x["steps"]] == [s["kb"] for s in q["steps"]]
        assert [s["answer"] for s in x["steps"]] == [s["answer"] for s in q["steps"]]
        assert len(x["ids"]) == len(x["mask"]) == len(x["logprobs"])
        # exactly the span tokens are the policy's; each span decodes to one well-formed step
        in_span = [0] * len(x["ids"])
        for sp in x["spans"]:
            in_span[sp["start"]:sp["end"]] = [1] * (sp["end"] - sp["start"])
            text = tok.decode(x["ids"][sp["start"]:sp["end"]])
            assert (reward.parse_route if sp["kind"] == "route" else reward.parse_answer)(text).ok, text
            assert "<|im_end|>" not in text and "Retrieved by" not in text
        assert in_span == x["mask"]
        stop = ["route"] if len(q["steps"]) < 3 else []  # after max_steps=3 sub-questions the final answer is forced
        assert [sp["kind"] for sp in x["spans"]] == ["route", "answer"] * len(q["steps"]) + stop + ["final"]
        # the evidence (masked out) is what the retriever really returned for the sub-question
        full = tok.decode(x["ids"])
        for st in x["steps"]:
            hit = retriever.search([st["sub_question"]], st["kb"], 3)[0]
            assert [d["id"] for d in hit] == st["retrieved"] and hit[0]["contents"] in full
    hits = [g["doc_id"] in s["retrieved"] for q, x in zip(qs, trajs) for g, s in zip(q["steps"], x["steps"])]
    assert sum(hits) / len(hits) > 0.9

    class Counting(rollout.GoldPolicy):  # records the most requests ever in flight at once
        peak = 0
        def poll(self):
            self.peak = max(self.peak, len(self.__dict__.get("queue", [])))
            return super().poll()
    eng = Counting(tok, qs)
    capped = rollout.rollout(eng, retriever, qs, s=rollout.Settings(max_active=4))
    assert eng.peak == 4 and [x["ids"] for x in capped] == [x["ids"] for x in trajs]  # same trajectories, 4 at a time

def test_a_trajectory_that_outgrows_the_context_ends_alone(tiny_index, retriever, hf_engine, monkeypatch):
    qs = dataio.load_questions(tiny_index, "train")[:8]
    full = rollout.rollout(rollout.GoldPolicy(hf_engine.tok, qs), retriever, qs)
    eng = rollout.GoldPolicy(hf_engine.tok, qs)
    eng.max_len = 96 + sorted(len(x["ids"]) for x in full)[4] - 40  # about half the trajectories fit
    capped = rollout.rollout(eng, retriever, qs, s=rollout.Settings(max_active=3))
    for x, y in zip(full, capped):
        if len(x["ids"]) - (x["spans"][-1]["end"] - x["spans"][-1]["start"]) + 96 <= eng.max_len:  # ok up to its last turn
            assert y["ids"] == x["ids"] and y["format_ok"] and not y["overflow"]
        else:  # cut off, not a format failure: every span it wrote parsed, and it has no final answer
            assert y["overflow"] and y["format_ok"] and y["final_answer"] is None
            assert f"exceed the engine's max_len {eng.max_len}" in y["error"]
            assert len(y["ids"]) + 96 > eng.max_len and x["ids"][:len(y["ids"])] == y["ids"]
    assert 0 < sum(y["overflow"] for y in capped) < len(qs)
    full = baselines.answer_directly(hf_engine, retriever, qs, kbs=("text", "table", "image"), s=rollout.Settings(answer_tokens=8))
    prompt_len = sorted(len(x["ids"]) - x["n_policy_tokens"] for x in full)
    monkeypatch.setattr(hf_engine, "max_len", prompt_len[4] + 8, raising=False)  # the 5 shortest prompts fit
    direct = baselines.answer_directly(hf_engine, retriever, qs, kbs=("text", "table", "image"), s=rollout.Settings(answer_tokens=8))
    for x, y in zip(full, direct):
        n = len(x["ids"]) - x["n_policy_tokens"]  # the prompt
        if n + 8 <= hf_engine.max_len:
            assert y["ids"][:n] == x["ids"][:n] and y["n_policy_tokens"] > 0
        else:
            assert y["overflow"] and "exceed the engine's max_len" in y["error"] and y["ids"] == []

def test_gold_policy_writes_at_a_stored_prefix_what_the_loop_wrote_there(tiny_index, retriever, hf_engine):
    # the policy turn a key names is the whole of GoldPolicy's state: asked at every prefix of a gold trajectory (either
    # structure, a 3-step cap that forces some final answers early) by turn_key, it writes the span the loop wrote there
    tok = hf_engine.tok
    qs = dataio.load_questions(tiny_index, "train")[:12]
    for s in (rollout.Settings(), rollout.Settings(structure="released"), rollout.Settings(max_steps=1)):
        eng = rollout.GoldPolicy(tok, qs)
        trajs = rollout.rollout(eng, retriever, qs, s=s)
        for x, sp, ids, _ in rollout.span_prefixes(trajs):
            stop = ["</answer>"] if sp["kind"] != "route" else rollout.route_stop(tok, s)[0]
            (out, _), = eng.generate([ids], 1024, stop=stop, keys=[rollout.turn_key(x, sp)])
            assert out == x["ids"][sp["start"]:sp["end"]]
        assert any(len(x["steps"]) < len(q["steps"]) for q, x in zip(qs, trajs)) == (s.max_steps == 1)
    with pytest.raises(ValueError, match="pass keys"):
        eng.generate([ids], 8, stop=stop)

def test_released_structure_gives_each_step_its_own_chat(tiny_index, retriever, hf_engine):
    # R1-Router's released structure through the real loop: the gold policy's steps and answers are unchanged, and each
    # step is one chat: routing holds the question and earlier pairs but no passages, answering holds the passages and
    # the sub-question but not the question, the final chat holds the pairs
    tok = hf_engine.tok
    qs = dataio.load_questions(tiny_index, "train")[:12]
    trajs = rollout.rollout(rollout.GoldPolicy(tok, qs), retriever, qs, s=rollout.Settings(structure="released"))
    for q, x in zip(qs, trajs):
        assert x["format_ok"] and x["final_answer"] == q["answers"][0]
        assert [s["kb"] for s in x["steps"]] == [s["kb"] for s in q["steps"]]
        assert len(x["segments"]) == len(x["spans"]) and x["segments"][-1][1] == len(x["ids"])
        in_span = [0] * len(x["ids"])
        for (a, b), sp in zip(x["segments"], x["spans"]):  # one policy span a chat, at its end
            in_span[sp["start"]:sp["end"]] = [1] * (sp["end"] - sp["start"])
            chat = tok.decode(x["ids"][a:sp["start"]])
            system = {"route": prompts.RELEASED_ROUTE_PROMPT, "answer": prompts.RELEASED_ANSWER_PROMPT,
                      "final": prompts.RELEASED_FINAL_PROMPT}[sp["kind"]]
            assert chat.count("<|im_start|>system") == 1 and system in chat and a <= sp["start"] < sp["end"] <= b
            earlier = x["steps"][:sp["step"]]
            if sp["kind"] == "answer":
                st = x["steps"][sp["step"]]
                assert chat.endswith(f"to the Question: {st['sub_question']}<|im_end|>\n<|im_start|>assistant\n")
                assert "Origin question" not in chat
                assert all(d["contents"] in chat for d in retriever.search([st["sub_question"]], st["kb"], 3)[0])
            else:
                assert f"Origin question: {x['question']}" in chat and "-0: " not in chat  # no passages
                assert all(f"Sub-question{k + 1}: {e['sub_question']}\nAnswer{k + 1}: {e['answer']}" in chat
                           for k, e in enumerate(earlier))
        assert in_span == x["mask"]
    _, prefixes = rollout.golden_prefixes(tok, retriever, qs, rollout.Settings(structure="released"))
    assert all(tok.decode(ids).startswith("<|im_start|>system") and tok.decode(ids).count("<|im_start|>system") == 1
               for _, _, ids, _ in prefixes)

def test_max_steps_forces_the_final_answer(tiny_index, retriever, hf_engine):
    qs = [q for q in dataio.load_questions(tiny_index, "train") if q["type"] == "3hop"][:3]
    trajs = rollout.rollout(rollout.GoldPolicy(hf_engine.tok, qs), retriever, qs, s=rollout.Settings(max_steps=2))
    for x in trajs:
        assert len(x["steps"]) == 2 and x["format_ok"] and x["spans"][-1]["kind"] == "final"
        assert prompts.LAST_STEP_NOTE in hf_engine.tok.decode(x["ids"])

def test_the_progress_bar_counts_finished_trajectories(tiny_index, retriever, hf_engine):
    from tqdm import tqdm
    qs = dataio.load_questions(tiny_index, "dev")[:5]
    seen = []

    class Bar(tqdm):  # records the count after every update: it rises question by question, not once at the end
        def update(self, n=1):
            super().update(n)
            seen.append(self.n)
    with Bar(total=2 * len(qs), file=io.StringIO()) as bar:
        rollout.rollout(rollout.GoldPolicy(hf_engine.tok, qs), retriever, qs, 2, rollout.Settings(max_active=3), bar=bar)
    assert bar.n == 2 * len(qs) and seen == sorted(seen) and len(set(seen)) > 2

def test_show_prints_what_the_model_wrote_where_the_format_broke(tiny_index, retriever, hf_engine, capsys):
    class Rambler(rollout.GoldPolicy):  # writes prose instead of the routing step
        def step_text(self, q, turn, phase):
            return "I think the answer is Paris." if phase == "route" else super().step_text(q, turn, phase)
    qs = dataio.load_questions(tiny_index, "dev")[:1]
    x = rollout.rollout(Rambler(hf_engine.tok, qs), retriever, qs)[0]
    assert not x["format_ok"]
    rollout.show(x, hf_engine.tok)
    assert "wrote (route step 1): 'I think the answer is Paris.'" in capsys.readouterr().out

def test_oracle_and_all_kb_modes(tiny_index, retriever, hf_engine):
    qs = [q for q in dataio.load_questions(tiny_index, "train") if len(q["steps"]) == 1][:4]
    wrong = [dict(q, steps=[dict(q["steps"][0], kb="image" if q["steps"][0]["kb"] != "image" else "text")]) for q in qs]
    oracle = rollout.rollout(rollout.GoldPolicy(hf_engine.tok, wrong), retriever, qs, s=rollout.Settings(route_mode="oracle"))
    assert [x["steps"][0]["kb"] for x in oracle] == [q["steps"][0]["kb"] for q in qs]
    every = rollout.rollout(rollout.GoldPolicy(hf_engine.tok, qs), retriever, qs, s=rollout.Settings(route_mode="all", topk=2))
    for x in every:
        assert len(x["steps"][0]["retrieved"]) == 6  # top-2 from each of the three KBs
        assert {d.split("-")[0] for d in x["steps"][0]["retrieved"]} == {"text", "table", "image"}

def test_vllm_and_hf_agree_greedily(tiny_index, retriever, vllm_engine, hf_engine):
    prompts = [hf_engine.tok.encode(t) for t in ["Hello there", "Who founded the company?", "x y z " * 20]]
    a = vllm_engine.generate(prompts, 24, temperature=0.0)
    b = hf_engine.generate(prompts, 24, temperature=0.0)
    for (ids_a, lp_a), (ids_b, lp_b) in zip(a, b):
        assert ids_a == ids_b
        assert torch.allclose(torch.tensor(lp_a), torch.tensor(lp_b), atol=1e-3)
    qs = dataio.load_questions(tiny_index, "dev")[:6]
    s = rollout.Settings(temperature=0.0, route_tokens=24, answer_tokens=24)
    ta, tb = rollout.rollout(vllm_engine, retriever, qs, s=s), rollout.rollout(hf_engine, retriever, qs, s=s)
    for x, y in zip(ta, tb):
        assert x["ids"] == y["ids"] and x["error"] == y["error"]
        assert not x["format_ok"] and x["error"].startswith("step 1 route:")  # a random model cannot write the format

def test_sampling_gives_distinct_samples_and_policy_logprobs(tiny_index, retriever, vllm_engine):
    qs = dataio.load_questions(tiny_index, "dev")[:2]
    trajs = rollout.rollout(vllm_engine, retriever, qs, n=4, s=rollout.Settings(route_tokens=16), seed=1)
    assert len(trajs) == 8 and [x["sample"] for x in trajs[:4]] == [0, 1, 2, 3]
    assert len({tuple(x["ids"]) for x in trajs[:4]}) > 1
    x = trajs[0]
    pol = [lp for lp, m in zip(x["logprobs"], x["mask"]) if m]
    ref = vllm_engine.prompt_logprobs(x["ids"])  # logprob of token t given the prefix, under the same weights
    ref_pol = [lp for lp, m in zip(ref, x["mask"][1:]) if m]
    assert len(pol) == len(ref_pol) > 0 and torch.allclose(torch.tensor(pol), torch.tensor(ref_pol), atol=1e-3)

def test_sampled_logprobs_are_those_of_the_tempered_distribution(tiny_model, vllm_engine, hf_engine):
    # sampling at temperature 0.7, both engines report each token's logprob under softmax(logits / 0.7), which is what
    # the trainer computes with --temperature 0.7, and not the untempered one
    import grpo
    prompt = vllm_engine.tok.encode("Which country is Uldoria in? The answer is")
    model = hf_engine.model
    for engine in (vllm_engine, hf_engine):
        (ids, lps), = engine.generate([prompt], 12, temperature=0.7, seed=0)
        full = torch.tensor([prompt + ids])
        sel = torch.zeros(1, full.shape[1] - 1, dtype=torch.bool)
        sel[0, len(prompt) - 1:] = True
        with torch.no_grad():
            tempered, plain = (grpo.token_logprobs(model, full, torch.ones_like(full), sel, None, t)[0] for t in (0.7, 1.0))
        assert len(ids) > 3 and torch.allclose(torch.tensor(lps), tempered, atol=1e-4)
        assert (torch.tensor(lps) - plain).abs().max() > 1e-2

def test_sync_weights_changes_the_engine_to_the_new_model(tiny_model, vllm_engine, hf_engine):
    from transformers import AutoModelForCausalLM
    ids = hf_engine.tok.encode("The mayor of Felo is Ly Normi, and the capital is Uldoria.")
    old = torch.tensor(vllm_engine.prompt_logprobs(ids))
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    original = copy.deepcopy(model.state_dict())
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    def hf_logprobs(m):
        with torch.no_grad():
            lp = m(torch.tensor([ids])).logits[0, :-1].log_softmax(-1)  # [T-1, V]
        return lp.gather(-1, torch.tensor(ids[1:]).unsqueeze(-1)).squeeze(-1)
    vllm_engine.sync_weights(model.state_dict())
    new = torch.tensor(vllm_engine.prompt_logprobs(ids))
    assert torch.allclose(new, hf_logprobs(model), atol=1e-4)
    assert (new - old).abs().max() > 1e-2
    vllm_engine.sync_weights(original)  # and back: the engine follows every sync
    assert torch.allclose(torch.tensor(vllm_engine.prompt_logprobs(ids)), old, atol=1e-5)

def test_a_sync_that_leaves_out_a_parameter_or_a_fused_shard_exits(tiny_model, vllm_engine):
    # vLLM alone warns about a missing parameter and says nothing about a missing q_proj (a shard of its fused
    # qkv_proj), whose memory is then uninitialised: the engine's check names either. A complete sync passes, scores
    # like the new weights, and logs no RotaryEmbedding "Failed to load weights" (a real warning still shows)
    import logging

    from transformers import AutoModelForCausalLM
    ids = vllm_engine.tok.encode("The mayor of Felo is Ly Normi, and the capital is Uldoria.")
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    original = {k: v.clone() for k, v in model.named_parameters()}
    torch.manual_seed(2)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    new = dict(model.named_parameters())  # no lm_head: tied to the embedding, the engine copies it
    records = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(r.getMessage())
    logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addHandler(handler)
    try:
        for name in ("model.layers.1.post_attention_layernorm.weight", "model.layers.0.self_attn.q_proj.weight",
                     "model.layers.1.mlp.gate_proj.weight"):
            with pytest.raises(SystemExit, match=f"^error: weight sync left out 1 of 20 parameters: {name}$"):
                vllm_engine.sync_weights({k: v for k, v in new.items() if k != name})
        assert "RMSNorm: Failed to load weights" in records
        records.clear()
        vllm_engine.sync_weights(new)
        assert not [r for r in records if "Failed to load weights" in r]
    finally:
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").removeHandler(handler)
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0, :-1].log_softmax(-1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert torch.allclose(torch.tensor(vllm_engine.prompt_logprobs(ids)), want, atol=1e-4)
    vllm_engine.sync_weights(original)  # the module's other tests use the original weights

def test_hf_engine_sync_is_strict(tiny_model):
    # every parameter must come (the tied head may or may not: it is the embedding), and an unknown name exits
    from transformers import AutoModelForCausalLM
    engine = engines.HFEngine(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    torch.manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    new = {k: v.detach() for k, v in model.named_parameters()}
    with pytest.raises(SystemExit, match="^error: weight sync left out 1 of 20 parameters: model.norm.weight$"):
        engine.sync_weights({k: v for k, v in new.items() if k != "model.norm.weight"})
    with pytest.raises(SystemExit, match="^error: weight sync: the engine's model has no weight model.nrom.weight$"):
        engine.sync_weights({**new, "model.nrom.weight": new["model.norm.weight"]})
    ids = engine.tok.encode("The mayor of Felo is Ly Normi.")
    for weights in (new, model.state_dict()):  # without and with the tied lm_head
        engine.sync_weights(weights)
        with torch.no_grad():
            want = model(torch.tensor([ids])).logits[0, :-1].log_softmax(-1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
        assert torch.allclose(torch.tensor(engine.prompt_logprobs(ids)), want, atol=1e-5)

def test_direct_baselines(tiny_index, retriever, hf_engine):
    qs = dataio.load_questions(tiny_index, "dev")[:5]
    s = rollout.Settings(temperature=0.0, answer_tokens=16)
    none = baselines.answer_directly(hf_engine, retriever, qs, (), s)
    rag = baselines.answer_directly(hf_engine, retriever, qs, ("text", "table", "image"), s)
    for q, x, y in zip(qs, none, rag):
        assert x["steps"] == [] and [st["kb"] for st in y["steps"]] == ["text", "table", "image"]
        assert len(y["ids"]) > len(x["ids"]) and sum(y["mask"]) == y["n_policy_tokens"] > 0
        assert y["steps"][0]["retrieved"] == [d["id"] for d in retriever.search([q["question"]], "text", 3)[0]]
        ans = x["final_answer"] or ""
        assert ans == " ".join(ans.split()) and "<" not in ans and x["format_ok"] == bool(ans)

def test_iterretgen_searches_with_the_previous_generation(tiny_index, retriever, hf_engine):
    # IterRetGen is a fixed pipeline, whatever the model writes: round 1 searches every KB with the question, round 2
    # with the question plus round 1's generation; one round is single-shot RAG
    qs = dataio.load_questions(tiny_index, "dev")[:4]
    s = rollout.Settings(answer_tokens=12)  # sampled (seeded): the tiny random model's greedy text decodes to nothing
    one = baselines.answer_directly(hf_engine, retriever, qs, ("text", "table", "image"), s, seed=0, iters=1)
    two = baselines.answer_directly(hf_engine, retriever, qs, ("text", "table", "image"), s, seed=0, iters=2)
    for q, x, y in zip(qs, one, two):
        assert [st["kb"] for st in y["steps"]] == ["text", "table", "image"] * 2 and y["steps"][:3] == x["steps"]
        query = f"{q['question']} {x['final_answer']}"  # a random model writes no <answer> tags: its text is the answer
        assert all(st["sub_question"] == query for st in y["steps"][3:])
        assert [st["retrieved"] for st in y["steps"][3:]] == [[d["id"] for d in retriever.search([query], kb, 3)[0]]
                                                               for kb in ("text", "table", "image")]
        assert x["final_answer"] and y["n_policy_tokens"] == x["n_policy_tokens"] + sum(y["mask"])

class ScriptedChain:
    """An IRCoT policy whose round r writes "Fact r of the chain." and, at round `answer_at`, "So the answer is:
    Uldoria."; asked for the answer of a chain at the cap (the prompt ends with the reader's cue), "Ulla Brenmark"."""
    def __init__(self, tok, answer_at=None, empty_at=None):
        self.tok, self.answer_at, self.empty_at, self.round, self.prompts = tok, answer_at, empty_at, 0, []

    def generate(self, prompts, max_tokens, temperature=1.0, top_p=1.0, stop=(), seed=None, top_k=0, images=None,
                 keys=None):
        self.prompts.append([self.tok.decode(p) for p in prompts])
        r, self.round = self.round, self.round + 1
        text = lambda p: "Ulla Brenmark" if p.endswith(baselines.READER.strip()) else "" if r == self.empty_at else \
            "So the answer is: Uldoria." if r == self.answer_at else f"Fact {r} of the chain."  # noqa: E731
        return [(ids, [0.0] * len(ids)) for p in self.prompts[-1] for ids in [self.tok.encode(text(p), add_special_tokens=False)]]

@pytest.mark.parametrize("answer_at", [1, None, "empty"])
def test_ircot_makes_each_sentence_the_next_query_and_stops_at_the_answer_or_the_cap(tiny_index, hf_engine, answer_at):
    # the question searches every KB, then each sentence of the chain does; "answer is" ends the chain with its
    # answer; a chain that never says it stops after max_steps retrievals, or at an empty sentence, and its answer is
    # read off
    spy = Spy(tiny_index, "bm25")
    spy.calls = []
    qs = dataio.load_questions(tiny_index, "dev")[:3]
    policy = ScriptedChain(hf_engine.tok, None if answer_at == "empty" else answer_at, 1 if answer_at == "empty" else None)
    trajs = baselines.ircot(policy, spy, qs, s=rollout.Settings(max_steps=3))
    rounds = 3 if answer_at is None else 2  # retrievals: the question's, then one a sentence until the answer or the cap
    kbs = list(dataio.KBS)
    assert [kb for kb, _ in spy.calls] == kbs * rounds
    queries = [[q["question"] for q in qs]] + [[f"Fact {r} of the chain."] * 3 for r in range(rounds - 1)]
    assert [qq for kb, qq in spy.calls if kb == "text"] == queries
    assert len(policy.prompts) == {1: 2, None: 4, "empty": 3}[answer_at]  # the cap: 3 sentences, then the reader
    for x in trajs:
        assert x["final_answer"] == ("Uldoria" if answer_at == 1 else "Ulla Brenmark") and x["format_ok"]
        want = [x["question"]] + [f"Fact {r} of the chain." for r in range(rounds - 1)]
        assert [st["sub_question"] for st in x["steps"] if st["kb"] == "text"] == want
        assert len(x["steps"]) == len(kbs) * rounds
    last = policy.prompts[-1][0]  # the evidence of every round and the chain so far are in the last prompt
    assert "Fact 0 of the chain." in last and last.count("Retrieved by Text Retriever:") == 1
    if answer_at is None:
        assert last.endswith("Fact 0 of the chain. Fact 1 of the chain. Fact 2 of the chain." + baselines.READER)

def test_few_shot_prefix_puts_worked_examples_before_the_question(tiny_index, retriever, hf_engine):
    import evaluate
    train = dataio.load_questions(tiny_index, "train")
    examples = evaluate.few_shot_examples(train, 3)
    assert {s["kb"] for q in examples for s in q["steps"]} == {"text", "table", "image"}
    shots = rollout.few_shot_prefix(hf_engine.tok, retriever, examples)
    text = hf_engine.tok.decode(shots)
    assert text.count(prompts.SYSTEM_PROMPT.format(max_steps=3)) == 1
    for q in examples:  # each example: its question, every gold sub-question and its final answer
        assert q["question"] in text and q["answers"][0] in text
        assert all(st["sub_question"] in text for st in q["steps"])
    acting = rollout.Settings(actions=True)  # the same examples under a system prompt with the actions' note
    note = prompts.ACTIONS_NOTE.format(max_actions=acting.max_actions)
    acted = hf_engine.tok.decode(rollout.few_shot_prefix(hf_engine.tok, retriever, examples, acting))
    assert acted.count(note) == 1 and acted.replace(note, "") == text
    qs = dataio.load_questions(tiny_index, "dev")[:2]
    s = rollout.Settings(temperature=0.0, route_tokens=8)
    for x in rollout.rollout(hf_engine, retriever, qs, 1, s, shots=shots):
        assert x["ids"][:len(shots)] == shots and not any(x["mask"][:len(shots)])
        assert x["spans"][0]["start"] > len(shots)
        assert hf_engine.tok.decode(x["ids"][len(shots):x["spans"][0]["start"]]).count(x["question"]) == 1

class Flaky(rollout.GoldPolicy):
    """The gold policy, but the first `bad[phase]` attempts at every step come out malformed; records each prompt."""
    def __init__(self, tok, questions, bad):
        super().__init__(tok, questions)
        self.bad, self.attempts, self.prompts = bad, {}, []

    def generate(self, prompts, max_tokens, temperature=1.0, top_p=1.0, stop=(), seed=None, top_k=0, images=None,
                 keys=None):
        good, out = super().generate(prompts, max_tokens, temperature, top_p, stop, seed, keys=keys), []
        phase = "route" if "</ret>" in stop else "answer"
        for p, g, (i, _, turn) in zip(prompts, good, keys):
            self.prompts.append(self.tok.decode(p))
            self.attempts[i, turn, phase] = self.attempts.get((i, turn, phase), 0) + 1
            out.append((self.tok.encode("I am not sure.", add_special_tokens=False), [0.0] * 4)
                       if self.attempts[i, turn, phase] <= self.bad[phase] else g)
        return out

def test_released_evaluation_retries_reminds_and_falls_back(tiny_index, retriever, hf_engine):
    tok = hf_engine.tok
    qs = [q for q in dataio.load_questions(tiny_index, "train") if len(q["steps"]) == 2][:2]
    s = rollout.Settings(route_tries=5, answer_tries=3, fallback=True)
    eng = Flaky(tok, qs, dict(route=4, answer=2))  # every step right at the last try but one: the gold trajectory
    for q, x in zip(qs, rollout.rollout(eng, retriever, qs, s=s)):
        assert x["format_ok"] and x["final_answer"] == q["answers"][0] and x["error"] == ""
        assert [st["kb"] for st in x["steps"]] == [st["kb"] for st in q["steps"]]
    # the reminder follows the third malformed route, and only then
    reminded = [prompts.RELEASED_REMINDER in p for p in eng.prompts]
    assert any(reminded) and not reminded[0]
    eng = Flaky(tok, qs, dict(route=5, answer=3))  # out of tries: routing stops, answers are the raw text
    for x in rollout.rollout(eng, retriever, qs, s=s):
        assert x["format_ok"] and x["steps"] == [] and x["final_answer"] == "I am not sure."
        assert "route" in x["error"] and "stopped after 5 tries" in x["error"] and "raw text after 3 tries" in x["error"]
    strict = rollout.rollout(Flaky(tok, qs, dict(route=1, answer=0)), retriever, qs)  # one try: a format failure
    assert all(not x["format_ok"] and x["error"].startswith("step 1 route") for x in strict)
    # --protocol fallback: one try, then the released fallbacks (a malformed first route stops; the answer is raw)
    eng = Flaky(tok, qs, dict(route=1, answer=1))
    for x in rollout.rollout(eng, retriever, qs, s=rollout.Settings(fallback=True)):
        assert x["format_ok"] and x["steps"] == [] and x["final_answer"] == "I am not sure."
        assert x["error"] == "step 1 route: missing <think>...</think> (stopped after 1 tries); " \
                             "final answer: missing <think>...</think> (raw text after 1 tries); "
    assert len(eng.prompts) == 2 * len(qs)  # no second try

#### multi-query steps (--max_pairs > 1)

def test_one_query_a_step_reproduces_r1_routers_trajectories_token_for_token(tiny_index, retriever):
    # sha256 of the gold trajectories (ids, mask, spans; SmolLM2's tokenizer) of the tiny world's train and test
    # questions: the step loop, the every-KB mode and the released structure, as the code wrote them at 865eb14
    import hashlib
    import json
    from transformers import AutoTokenizer
    tok, h = AutoTokenizer.from_pretrained(prepare.DEFAULT_MODEL), hashlib.sha256()
    for split in ("train", "test"):
        qs = dataio.load_questions(tiny_index, split)
        for s in (rollout.Settings(), rollout.Settings(route_mode="all"), rollout.Settings(structure="released")):
            for x in rollout.rollout(rollout.GoldPolicy(tok, qs), retriever, qs, s=s):
                h.update(json.dumps([x["ids"], x["mask"], x["spans"]]).encode())
    assert h.hexdigest() == "56e40f98f164ddfde39b464334c30269e5c50a42f5da16e6aba4df4c58a751d1"

class Spy(retrievers.Retriever):
    """The real BM25 retriever, recording the queries of each search call."""
    calls = []
    def search(self, queries, kb, k=3, **kw):
        self.calls.append((kb, list(queries)))
        return super().search(queries, kb, k, **kw)

def test_multi_query_gold_steps_are_retrieved_in_one_batch_and_answered_together(tiny_index, retriever, hf_engine):
    tok = hf_engine.tok
    qs = dataio.load_questions(tiny_index, "train")
    comp = [q for q in qs if q["type"] == "comparison"][:6]
    chain = [q for q in qs if q["type"] in ("2hop", "3hop")][:6]
    assert len(comp) == len(chain) == 6
    spy, s2 = Spy(tiny_index, "bm25"), rollout.Settings(max_pairs=2)
    Spy.calls = []
    two = rollout.rollout(rollout.GoldPolicy(tok, comp + chain, max_pairs=2), spy, comp + chain, s=s2)
    one = rollout.rollout(rollout.GoldPolicy(tok, comp + chain), retriever, comp + chain)
    assert all(x["format_ok"] and x["final_answer"] == q["answers"][0] for q, x in zip(comp + chain, two))
    for q, x in zip(comp, two):
        a, b = q["steps"]
        assert [(st["sub_question"], st["kb"], st["step"]) for st in x["steps"]] == [
            (a["sub_question"], a["kb"], 0), (b["sub_question"], b["kb"], 0)]  # one routing step, two lookups
        assert [sp["kind"] for sp in x["spans"]] == ["route", "answer", "route", "final"]
        assert {st["answer"] for st in x["steps"]} == {f"{a['answer']}; {b['answer']}"}  # one answer covers both
        route = x["ids"][x["spans"][0]["start"]:x["spans"][0]["end"]]
        assert route[-1] == tok.eos_token_id  # the policy ends a multi-query step itself
        r = reward.parse_route(tok.decode(route, skip_special_tokens=True), max_pairs=2)
        assert r.ok and r.pairs == [(a["sub_question"], (a["kb"],)), (b["sub_question"], (b["kb"],))]
        # the evidence turn: each sub-question's passages under its own heading, both gold documents found
        evidence = tok.decode(x["ids"][x["spans"][0]["end"]:x["spans"][1]["start"]])
        assert evidence.count("<|im_end|>") == 1 and evidence.startswith("\n<|im_start|>user\nSub-question 1: ")
        i, j = evidence.index(f"Sub-question 1: {a['sub_question']}"), evidence.index(f"Sub-question 2: {b['sub_question']}")
        for st, part in ((x["steps"][0], evidence[i:j]), (x["steps"][1], evidence[j:])):
            hit = retriever.search([st["sub_question"]], st["kb"], 3)[0]
            assert [d["id"] for d in hit] == st["retrieved"] and all(d["contents"] in part for d in hit)
        assert a["doc_id"] in x["steps"][0]["retrieved"] and b["doc_id"] in x["steps"][1]["retrieved"]
        # both lookups went out in the same search call
        assert any(a["sub_question"] in c and b["sub_question"] in c for _, c in Spy.calls)
    assert sum(len(c) for _, c in Spy.calls) == sum(len(x["steps"]) for x in two)  # each lookup searched once
    rounds = max(len(reward.by_step(x["steps"])) for x in two)  # this engine runs phase by phase: all search at once
    assert len(Spy.calls) <= 3 * rounds  # one call per KB a round, however many lookups
    for x, y in zip(two[6:], one[6:]):  # chains cannot be asked at once: the same tokens, the end of turn now the policy's
        assert x["ids"] == y["ids"] and x["steps"] == [dict(st) for st in y["steps"]]
        diff = [k for k, (m, n) in enumerate(zip(x["mask"], y["mask"])) if m != n]
        assert diff == [sp["end"] - 1 for sp in x["spans"] if sp["kind"] == "route"]
        assert all(x["ids"][k] == tok.eos_token_id for k in diff)

def test_a_route_with_more_pairs_than_allowed_is_a_format_failure(tiny_index, retriever, hf_engine):
    tok = hf_engine.tok
    comp = [q for q in dataio.load_questions(tiny_index, "train") if q["type"] == "comparison"][:2]
    x = rollout.rollout(rollout.GoldPolicy(tok, comp, max_pairs=2), retriever, comp, s=rollout.Settings(max_pairs=1))[0]
    assert not x["format_ok"] and x["error"].startswith("step 1 route: two <sub-question> tags")
    # several retrievers for one sub-question (R1-Router's multi-retriever mode): one lookup per KB, one evidence turn
    q = dict(comp[0], steps=[dict(comp[0]["steps"][0], kb=kb) for kb in ("text", "table")])
    x = rollout.rollout(rollout.GoldPolicy(tok, [q]), retriever, [q], s=rollout.Settings(max_rets=2))[0]
    assert x["format_ok"] and [(st["kb"], st["step"]) for st in x["steps"]] == [("text", 0), ("table", 0)]
    assert "<ret>Text Retriever, Table Retriever</ret>" in tok.decode(x["ids"])

def test_hf_engine_samples_from_the_distribution_its_logprobs_describe(tmp_path, tok_dir):
    """A tiny model of its own whose generation_config, as Qwen2.5-Instruct's does, sets a repetition penalty and a
    top-k (and no top-k at all: transformers' default is 50). Greedy, the HF engine writes the argmax of the plain
    logits at every step; sampled at T 1 with top-k off, it draws beyond any top-k; with top_k 5, from the 5 best, and
    every returned logprob is that token's under exactly the distribution drawn from."""
    from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM
    tok = AutoTokenizer.from_pretrained(tok_dir)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=32, tie_word_embeddings=True,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    model.generation_config = GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                               repetition_penalty=3.0, top_k=3, top_p=0.5, temperature=0.3, do_sample=True)
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    engine = engines.HFEngine(tmp_path / "m")
    prompt = tok.encode("Which country is Uldoria in? The answer is")

    def logits_after(ids):  # [len(ids) - len(prompt), V]: the plain logits at each generated position
        with torch.no_grad():
            return engine.model(input_ids=torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1].float()

    (ids, lps), = engine.generate([prompt], 16, temperature=0)
    z = logits_after(ids)
    assert ids == z.argmax(-1).tolist() and len(set(ids)) < len(ids)  # a repetition the penalty would have forbidden
    assert torch.allclose(torch.tensor(lps), z.log_softmax(-1).gather(1, torch.tensor(ids)[:, None])[:, 0], atol=1e-4)
    first = lambda k: engine.generate([prompt] * 64, 1, temperature=1.0, top_k=k, seed=1)
    drawn = first(0)
    z = logits_after([0])[0]  # the logits before the first new token (a causal model: the appended 0 is not seen)
    assert len({i[0] for i, _ in drawn}) > 5  # top-k off: not the model's 3, nor transformers' 50 in effect
    assert all(abs(lp[0] - z.log_softmax(-1)[i[0]].item()) < 1e-4 for i, lp in drawn)
    top5 = z.topk(5)
    renorm = dict(zip(top5.indices.tolist(), top5.values.log_softmax(-1).tolist()))
    drawn = first(5)
    assert all(i[0] in renorm and abs(lp[0] - renorm[i[0]]) < 1e-4 for i, lp in drawn)


def test_the_hf_engine_takes_bf16_on_any_cuda_device():
    assert engines.hf_dtype("auto", "cuda:3") == engines.hf_dtype("auto", "cuda") == torch.bfloat16
    assert engines.hf_dtype("auto", "cpu") == torch.float32 and engines.hf_dtype("float32", "cuda:0") == torch.float32


def test_a_vl_engine_is_built_for_as_many_pictures_as_a_prompt_can_hold():
    # the question's picture and every evidence picture of every step: vLLM refuses a prompt with more than the
    # engine's limit_mm_per_prompt, so a fixed 16 refused --topk 5 --max_steps 4 (21) at input processing
    import evaluate
    assert rollout.Settings().max_images == 10 and rollout.Settings(max_steps=4, topk=5).max_images == 21
    assert rollout.Settings(max_pairs=2, max_rets=2).max_images == 37
    args = evaluate.get_args(["--max_steps", "4", "--topk", "2", "--protocol", "released"])  # released: top-5 evidence
    assert evaluate.settings_of(args.protocol, max_steps=args.max_steps, topk=args.topk).max_images == 21
