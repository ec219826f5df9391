#!/usr/bin/env bash
# One device call (H200), under 9 minutes by default (the default steps' limits add up to 530 s): every Triton kernel checked against its
# PyTorch reference (and timed), then the 8B-shaped offline workloads (a) (b) (c) and the
# Hugging Face baseline on (a); then one table (scripts/gpu/summary.py; also $OUT/summary.md; every
# log and JSON in $OUT/runs.tgz).
# More steps on request, e.g. ONLY="gpu_tests ttft ttft_eager a_sync": the GPU tier of the tests
# (`pytest -m gpu`: tests/gpu/, the engine, kernels, LoRA, FP8, sampler, structured outputs, and
# tensor parallelism given two GPUs; needs pytest in .whl, scripts/gpu/fetch_wheels.sh), batch-1 TTFT
# with and without piecewise CUDA graphs, (a) without async scheduling.
set -uo pipefail
DEFAULT_STEPS="kernels a hf b c"
source "$(dirname "$0")/lib.sh"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
setup_env
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
run kernels "${T_KERNELS:-150}" python3 scripts/gpu/bench_kernels.py --budget-s 100
run a "${T_A:-100}" python3 -m llmserve bench throughput $ENGINE --num-prompts 512 --input-len 512 --output-len 256 --output-json "$OUT/a.json"
run hf "${T_HF:-100}" python3 -m llmserve bench hf-baseline --model $M --load-format dummy --num-prompts 512 \
  --input-len 512 --output-len 256 --batch-size 128 --output-json "$OUT/hf.json"
run gpu_tests "${T_GPU_TESTS:-400}" python3 -m pytest tests/gpu -m gpu -n 0 -p no:cacheprovider --junitxml "$OUT/gpu_tests.xml"
run b "${T_B:-80}" python3 -m llmserve bench latency --model $M --load-format dummy --max-model-len 2048 --max-num-seqs 8 \
  --batch-size 1 --input-len 512 --output-len 256 --num-iters 5 --num-iters-warmup 2 --output-json "$OUT/b.json"
run c "${T_C:-100}" python3 -m llmserve bench throughput $ENGINE --num-prompts 1000 --input-len 1024 --output-len 128 --output-json "$OUT/c.json"
run a_sync "${T_A:-130}" python3 -m llmserve bench throughput $ENGINE --num-prompts 512 --input-len 512 --output-len 256 --no-async-scheduling --output-json "$OUT/a_sync.json"
run ttft "${T_TTFT:-120}" python3 scripts/gpu/probe_ttft.py
run ttft_eager "${T_TTFT:-120}" env MIXED=0 python3 scripts/gpu/probe_ttft.py
python3 scripts/gpu/summary.py "$OUT"
pack_out
