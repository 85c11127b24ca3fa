#!/usr/bin/env bash
# A GPU check anyone with one GPU can run: tiny random models (Qwen2, Qwen2.5-VL) built from configs, a tiny world with
# BM25 indexes, then SFT in bf16 with a save and an exact resume, Step-GRPO with the HF engine (and vLLM where it
# imports), LoRA and the visual path; one table of what passed, with peak memory. Offline, no downloaded weights,
# under 10 minutes (runs/gpu_check.py says more). `make gpu-check`; DRY=1 (or --dry): on the CPU in fp32, the GPU-only
# steps skipped. PY: the Python with torch and transformers (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."
exec ${PY:-python3} runs/gpu_check.py ${DRY:+--dry} "$@"
