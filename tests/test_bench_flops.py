"""bench_flops.py's FLOP count, against the parameter count of the real default policy: a forward is 2 FLOPs a
weight a token (the head read at that token) plus attention, which grows with the context."""
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import bench_flops
import prepare

def test_a_token_costs_two_flops_a_weight():
    cfg = AutoConfig.from_pretrained(prepare.DEFAULT_MODEL)
    with torch.device("meta"):
        n = sum(p.numel() for name, p in AutoModelForCausalLM.from_config(cfg).named_parameters() if "norm" not in name)
    # embeddings tied to the head: the embedding lookup costs nothing, the head 2 d V; every other weight 2 a token
    assert bench_flops.forward_flops(cfg, 1, 1, 0) == pytest.approx(2 * n, rel=1e-6)
    no_head = bench_flops.forward_flops(cfg, 10, 0, 0)
    assert bench_flops.forward_flops(cfg, 10, 0, 100) - no_head == 4 * cfg.num_hidden_layers * cfg.hidden_size * 100 * 10
    assert bench_flops.forward_flops(cfg, 10, 3, 0) - no_head == 3 * 2 * cfg.hidden_size * cfg.vocab_size
