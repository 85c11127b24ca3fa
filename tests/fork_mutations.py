"""
The mutations tests/test_fork.py says it catches, each applied to a copy of the checkout's tracked files, then the
fork test that should catch it run there: a mutation its test passes is MISSED, and the exit status is 1.

    .venv/bin/python tests/fork_mutations.py         # all of them, one after another (~5 min on 2 cores)
    .venv/bin/python tests/fork_mutations.py 5 13    # some, by number
    .venv/bin/python tests/fork_mutations.py --trainer   # the trainer's, listed in test_stepgrpo.py's docstring
    .venv/bin/python tests/fork_mutations.py --gpu       # the GPU path's, listed in test_gpu_phases.py's docstring

Each mutation is a real edit a fork could make by mistake (or an earlier version of this code had), as one exact
string replaced in one file; the list is the one in test_fork.py's docstring, in its order.
"""
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE1 = "test_a_new_step_reward_moves_the_advantages_as_it_says"
RECIPE4 = "test_a_new_advantage_estimator_reaches_every_rollout_mode"
KB_CHECK = "test_a_fourth_kb_added_to_the_table_reaches_the_prompt_parser_retrieval_and_reward"
KB_JOB = "test_a_fourth_kb_runs_through_the_whole_main_job"

# (what it breaks, file, the exact string, its replacement, the test that must fail)
MUTATIONS = [
    ("split credit's KB part hard-wired to R1-Router's 0.5 [KB right]", "steprewards.py",
     "kb_part = kb_credit(p, target, w, encode, r)", 'kb_part = 0.5 * float(kbs == route_kbs(x["steps"], t))',
     RECIPE1),
    ("split credit's wording half zeroed", "grpo.py",
     "a_rest = advantages([r - k for r, k in zip(rewards, kb_part)], estimator, std, scale)",
     "a_rest = advantages([r - k for r, k in zip(rewards, kb_part)], estimator, std, scale) * 0", RECIPE1),
    ("on-policy default credit the outcome alone", "stepgrpo.py",
     'arg("--reward", default="step"', 'arg("--reward", default="outcome"', RECIPE1),
    ("on-policy steps rebuilt without their sub-question", "steprewards.py",
     'sub_question=pairs[0][0] if pairs else "None",', 'sub_question="",', RECIPE1),
    ("make converts any MODEL folder", "Makefile",
     '@test "$(MODEL)" = "$(DEFAULT_MODEL)" || {', '@true || {',
     "test_a_model_folder_given_to_make_is_used_as_given"),
    ("the data stage without its model (stale reuse)", "Makefile",
     "$(DATA)/traj-top1/train.jsonl: synth.py $(DATA)/index/meta.json $(MODEL_STAMP)",
     "$(DATA)/traj-top1/train.jsonl: synth.py $(DATA)/index/meta.json $(MODEL)/config.json",
     "test_make_demo_with_another_model_after_one_remakes_the_data_and_retrains"),
    ("synth.py ignores --model", "synth.py",
     "tok = AutoTokenizer.from_pretrained(args.model)", "tok = AutoTokenizer.from_pretrained(prepare.DEFAULT_MODEL)",
     "test_synth_writes_the_given_models_tokens_and_refuses_one_without_a_chat_template"),
    ("no chat template: a traceback, not one line", "transcript.py",
     "if not tok.chat_template:", "if False:",
     "test_synth_writes_the_given_models_tokens_and_refuses_one_without_a_chat_template"),
    ("world generation picks a KB without relations", "corpus.py",
     "kb = rng.choice(VALUE_KBS)", "kb = rng.choice(KBS)", KB_JOB),
    ("the prompt names the first three KBs", "prompts.py",
     "RETRIEVERS = [kb.retriever for kb in KB_TABLE]", "RETRIEVERS = [kb.retriever for kb in KB_TABLE[:3]]", KB_CHECK),
    ("the released prompts name the three", "prompts.py",
     "    new = [kb for kb in KB_TABLE if kb.name not in", "    new = [] and [kb for kb in KB_TABLE if kb.name not in",
     KB_CHECK),
    ("the parser reads the three retriever names", "reward.py",
     "KB_TO_RET = {kb.name: kb.retriever for kb in KB_TABLE}", "KB_TO_RET = {kb.name: kb.retriever for kb in KB_TABLE[:3]}",
     KB_CHECK),
    ("the indexes skip a fourth KB", "retrievers.py",
     "meta = dict(methods=list(methods), kbs={})\n    for kb in KBS:",
     "meta = dict(methods=list(methods), kbs={})\n    for kb in KBS[:3]:", KB_CHECK),
    ("the checkpoint's format does not record the KBs", "transcript.py",
     '"kbs": list(KBS)}', '"kbs": ["text", "table", "image"]}', KB_CHECK),
    ("importers drop a KB's own fields", "importers.py",
     "for f, typ in KB_OF[kb].fields.items() if f not in doc}", "for f, typ in KB_OF[kb].fields.items() if False}",
     KB_CHECK),
    ("metrics count the three KBs", "metrics.py",
     'from dataio import KBS  # ("text", "table", "image")', 'KBS = ("text", "table", "image")', KB_JOB),
    ("the report's table has the three KBs' columns", "report.py",
     'from dataio import KBS  # ("text", "table", "image")', 'KBS = ("text", "table", "image")', KB_JOB),
    ("evaluate.py's every-KB baselines search the three", "evaluate.py",
     'kbs = () if method == "no_retrieval" else KBS', 'kbs = () if method == "no_retrieval" else KBS[:3]', KB_JOB),
    ("--adv_estimator read but not used", "stepgrpo.py",
     "args.adv_estimator, args.adv_std, args.teacher_spans",
     '"grpo", args.adv_std, args.teacher_spans', RECIPE4),
    ("split credit's KB part normalised by GRPO's estimator whatever the flag", "grpo.py",
     "a_kb = advantages(kb_part, estimator, std, scale)", 'a_kb = advantages(kb_part, "grpo", std, scale)', RECIPE4),
    ("on-policy outcomes normalised by GRPO's estimator whatever the flag", "grpo.py",
     "R = advantages(outcomes, estimator, std)", "R = norm(outcomes, std=std)", RECIPE4),
    ("branch groups normalised by GRPO's estimator whatever the flag", "groups.py",
     "adv = grpo.advantages(rs, run.estimator, run.adv_std, scale)\n        rows += [dict(r, group=(group[0]",
     "adv = grpo.norm(rs, std=run.adv_std) * scale\n        rows += [dict(r, group=(group[0]", RECIPE4),
]

CLIPS = "tests/test_stepgrpo.py::test_clip_higher_gspos_ratio_and_tis_each_change_the_update"
MINI = "tests/test_stepgrpo.py::test_minibatches_split_the_rows_once_and_one_is_the_whole_batch_bit_for_bit"
# the trainer's (--trainer), listed in test_stepgrpo.py's docstring: each test must fail under its mutation
TRAINER = [
    ("the ratio's high clip fixed at 0.2 whatever --clip_high", "learner.py",
     "(cfg.clip_low, cfg.clip_high)", "(cfg.clip_low, 0.2)", CLIPS),
    ("the ratio's low clip fixed at 0.2 whatever --clip_low", "learner.py",
     "(cfg.clip_low, cfg.clip_high)", "(CLIP_LOW, cfg.clip_high)",
     "tests/test_stepgrpo.py::test_gspo_clip_range_is_reachable_from_the_command_line"),
    ("GSPO's sequence ratio dropped (every ratio per token)", "learner.py",
     'seq = spans_of(m.sel) if cfg.ratio == "sequence" else None', "seq = None", CLIPS),
    ("the TIS weights dropped from the loss", "grpo.py",
     "pg = pg * tis if tis is not None else pg", "pg = pg", CLIPS),
    ("the sampler's logprobs as old under --old_logprobs trainer", "learner.py",
     "                old = logp_trainer", "                pass",
     "tests/test_stepgrpo.py::test_entropy_bonus_gradient_and_trainer_old_logprobs"),
    ("the first minibatch share run in place of every other", "learner.py",
     "part, g = update(model, opt, mb, olds[a:b], refs[a:b], denom, cfg, sup)",
     "part, g = update(model, opt, *shares[0][:1], olds[:cuts[1]], refs[:cuts[1]], shares[0][1], cfg, sup)",
     MINI),
    ("a share's old logprobs taken from the front of the list", "learner.py",
     "part, g = update(model, opt, mb, olds[a:b], refs[a:b], denom, cfg, sup)",
     "part, g = update(model, opt, mb, olds[:b - a], refs[:b - a], denom, cfg, sup)", MINI),
    ("an optimizer step taken on a non-finite gradient", "learner.py",
     "    if math.isfinite(grad_norm):  # else skipped", "    if True:  # else skipped",
     "tests/test_stepgrpo.py::test_a_non_finite_gradient_skips_the_step_and_a_run_of_them_stops"),
    ("an empty minibatch share where a rank has fewer rows", "learner.py",
     "    k = max(1, min(cfg.minibatches, int(fewest)))", "    k = cfg.minibatches",
     "tests/test_stepgrpo.py::test_fewer_rows_than_minibatches_take_one_step_a_row"),
]

# the GPU path's that the CPU can catch (--gpu), listed in test_gpu_phases.py's docstring
PHASES = "tests/test_gpu_phases.py::"
GPU = [
    ("every vLLM engine built with sleep mode on a GPU (a judge beside the policy's dies)", "engines.py",
     "if self.can_sleep else {}", "if not on_cpu else {}",
     PHASES + "test_only_the_engine_that_sleeps_takes_vllms_sleep_mode"),
    ("the CUDA graphs kept on the GPU through the engine's sleep", "engines.py",
     "dict(enable_sleep_mode=True, sleep_mode_offload_cudagraph=True)", "dict(enable_sleep_mode=True)",
     PHASES + "test_only_the_engine_that_sleeps_takes_vllms_sleep_mode"),
    ("the sync check's trainer forward after the engine wakes", "trainutil.py",
     "            mine = trainer_logprobs(model, row, engine.vis)\n        t = time.perf_counter()\n"
     "        engine.sync_weights(policy_params(model))\n",
     "            pass\n        t = time.perf_counter()\n        engine.sync_weights(policy_params(model))\n"
     "        mine = trainer_logprobs(model, row, engine.vis) if check else None\n",
     PHASES + "test_the_sync_check_scores_the_trainer_before_the_engine_wakes"),
    ("the sync check's forward left gathered", "trainutil.py", "    reshard(model)\n    return mine",
     "    return mine", PHASES + "test_the_sync_check_scores_the_trainer_before_the_engine_wakes"),
    ("a packed group scored whole by the sync check", "trainutil.py", 'if "seg" in row:', "if False:",
     PHASES + "test_the_sync_check_scores_a_row_the_engine_takes"),
    ("the KL reference in eval mode under FlexAttention", "trainutil.py", "model.train(train or frozen_flex)",
     "model.train(train)", PHASES + "test_the_reference_keeps_the_policys_training_flag_under_flex_attention"),
    ("the policy left gathered after a critic warm-up", "learner.py", "    if warmup:  # no policy backward",
     "    if False:  # no policy backward", PHASES + "test_a_critic_warmup_leaves_the_policy_sharded"),
]

def checkout_copy(dest):
    """The tracked files (as they are in the working tree), the venv and the model folder linked."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    for f in filter(None, files.split("\0")):
        (dest / f).parent.mkdir(parents=True, exist_ok=True)
        (dest / f).write_bytes((ROOT / f).read_bytes())
    (dest / ".venv").symlink_to(ROOT / ".venv")
    (dest / "models").symlink_to(ROOT / "models")

def node(test):
    """A mutation's test as pytest's node id: a bare name is test_fork.py's."""
    return test if "::" in test else f"tests/test_fork.py::{test}"

def run(i, mutations=MUTATIONS):
    what, path, old, new, test = mutations[i - 1]
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp)
        checkout_copy(copy)
        (copy / path).write_text((copy / path).read_text().replace(old, new))
        r = subprocess.run([str(copy / ".venv/bin/python"), "-m", "pytest", "-q", "-x", "-n", "0", "-p",
                            "no:cacheprovider", node(test)], cwd=copy, capture_output=True, text=True)
    caught = r.returncode == 1  # a test failed (2-5: an error of the run itself, not a catch)
    print(f"{i:2d}. {'caught' if caught else 'MISSED'}  {what}  ({path}; {test}, rc {r.returncode})", flush=True)
    if r.returncode not in (0, 1):
        print(r.stdout[-1500:] + r.stderr[-1500:])
    return caught

def stale(root=ROOT):
    """What keeps a mutation from meaning what it says in the checkout at root: not listed in its test file's
    docstring (test_fork.py's, test_stepgrpo.py's), its string not exactly once in its file (the code moved on), or
    its test gone."""
    out = []
    for name, mutations in (("", MUTATIONS), ("trainer ", TRAINER), ("gpu ", GPU)):
        for i, (what, path, old, new, test) in enumerate(mutations, 1):
            file, fn = node(test).split("::")
            tests, n = (root / file).read_text(), (root / path).read_text().count(old)
            out += [f"{name}mutation {i}: not in {file}'s docstring"] if f"{i:2d}. {what}\n" not in tests else []
            out += [f"{name}mutation {i}: {path} holds its string {n} times, not once"] if n != 1 else []
            out += [f"{name}mutation {i}: no test {fn}"] if f"def {fn}(" not in tests else []
    return out

if __name__ == "__main__":
    problems = stale()
    if problems:
        sys.exit("\n".join(problems))
    mutations = TRAINER if "--trainer" in sys.argv else GPU if "--gpu" in sys.argv else MUTATIONS
    picks = [int(a) for a in sys.argv[1:] if not a.startswith("--")] or range(1, len(mutations) + 1)
    missed = [i for i in picks if not run(i, mutations)]
    print(f"{len(picks) - len(missed)} of {len(picks)} caught" + (f"; missed: {missed}" if missed else ""))
    sys.exit(1 if missed else 0)
