"""--offload (FSDP2's CPUOffloadPolicy) where a CPU-only machine can see it. On the CPU the policy
moves nothing (the shards are in host memory either way), so a run with it equals one without
whether it is set or not (tests/test_ppo.py, tests/test_sft.py). These tests look at what it sets:
the policy load_sharded asks FSDP2 for on CUDA (pinned) and on the CPU; that policy on every FSDP
unit of each model a PPO run loads with --offload (policy, KL reference, critic; LoRA too); and,
between optimizer steps on load_sharded's meta-to-device path, each parameter recorded by FSDP2 as
offloaded, its shard, gradient and AdamW moments in host memory, its compute on the device asked
for. tests/test_gpu.py checks the placement itself on a GPU (skipped here)."""
import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, OffloadPolicy

import stepgrpo
import trainutil

CPU = torch.device("cpu")

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

@pytest.fixture
def group():
    """A gloo group of one for load_sharded on the CPU (an existing group is left to its owner)."""
    own = trainutil.init_group(1, device=CPU)
    yield
    if own and dist.is_initialized():
        dist.destroy_process_group()

def units(model):
    """Every FSDP unit of `model` (its blocks and the root): [(module, its FSDP2 param group)]."""
    return [(m, m._get_fsdp_state()._fsdp_param_group) for m in model.modules()
            if isinstance(m, FSDPModule)]

def fsdp_params(model):
    return [fp for _, g in units(model) for fp in g.fsdp_params]

def moments(opt):
    """AdamW's exp_avg and exp_avg_sq of every parameter it steps."""
    return [v for st in opt.state.values() for k, v in st.items() if k in ("exp_avg", "exp_avg_sq")]

def test_offload_asks_fsdp2_for_host_memory_pinned_on_cuda():
    # what load_sharded hands fully_shard, asked for a GPU too (no GPU needed to ask): on CUDA
    # pinned host memory, with which FSDP2 moves each shard to the host as to_empty makes it and
    # copies asynchronously; on the CPU unpinned (pinning needs an accelerator); without --offload
    # the base class, which offloads nothing
    cuda = torch.device("cuda", 0)
    assert trainutil.offload_policy(cuda, True) == CPUOffloadPolicy(pin_memory=True)
    assert trainutil.offload_policy(CPU, True) == CPUOffloadPolicy(pin_memory=False)
    assert all(type(trainutil.offload_policy(d, False)) is OffloadPolicy for d in (cuda, CPU))

@pytest.mark.parametrize("lora", [False, True])
def test_offload_reaches_every_unit_of_the_policy_reference_and_critic(tiny_model_dir, lora, group):
    # stepgrpo's set-up of a PPO run with a KL penalty, from its command line: the policy, its KL
    # reference (a second model without LoRA; LoRA's is the policy with its adapters off) and the
    # critic, each with every parameter in an FSDP unit (the blocks and the root), every unit
    # offloaded and FSDP2 recording each parameter so; without --offload none is
    def setup(*extra):
        args = stepgrpo.get_args(["--model", str(tiny_model_dir), "--rollout", "onpolicy",
                                  "--adv_estimator", "gae", "-n", "1", "--kl_in_reward", "0.1",
                                  "--backend", "hf", "--dtype", "fp32",
                                  *(["--lora_r", "4"] if lora else []), *extra])
        lo, start = trainutil.lora_of(args.lora_r, args.quant), str(tiny_model_dir)
        p, _, _ = stepgrpo.setup_policy(args, start, start, False, lo, 0, 1, CPU,
                                        lambda *a, **k: None)
        return [p.model, p.crit[0]] + ([] if lora else [p.ref])
    models = setup("--offload")
    assert len(models) == (2 if lora else 3) and all(m is not None for m in models)
    for model in models:
        found = units(model)
        assert len(found) == len(trainutil.blocks(model)) + 1
        assert {id(fp.sharded_param) for fp in fsdp_params(model)} == \
            {id(p) for p in model.parameters()}  # no parameter outside a unit
        assert all(g.offload_policy == CPUOffloadPolicy(pin_memory=False) for _, g in found)
        assert all(fp.offload_to_cpu for fp in fsdp_params(model))
    for model in setup():
        assert not any(isinstance(g.offload_policy, CPUOffloadPolicy) for _, g in units(model))
        assert not any(fp.offload_to_cpu for fp in fsdp_params(model))

def test_offloaded_shards_grads_and_adam_state_stay_in_host_memory(tiny_model_dir, group):
    # load_sharded's path (built on meta, to_empty on the device, filled by the broadcast) with
    # --offload, then AdamW steps: after each backward and step FSDP2 holds every parameter as
    # offloaded and computes on the device asked for; shards (the storage FSDP2 copies to the device
    # for each all-gather is the one AdamW steps), gradients and Adam moments are in host memory
    model = trainutil.load_sharded(tiny_model_dir, CPU, 1, bf16=False, offload=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = {n: p.to_local().clone() for n, p in model.named_parameters()}  # a world of one
    ids = torch.randint(5, 4000, (2, 24), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        model(ids, labels=ids).loss.backward()
        assert all(p.grad.to_local().device == CPU for p in model.parameters())
        opt.step()
        opt.zero_grad()
        for fp in fsdp_params(model):
            shard = fp.sharded_param.to_local()
            assert fp.offload_to_cpu and fp.device == CPU and shard.device == CPU
            assert fp._sharded_param_data.data_ptr() == shard.data_ptr()
        assert len(moments(opt)) == 2 * len(before)
        assert all(v.to_local().device == CPU for v in moments(opt))
        assert trainutil.compute_device(model) == CPU
    assert all(not torch.equal(before[n], p.to_local()) for n, p in model.named_parameters())
