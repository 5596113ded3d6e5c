"""What the tests may expect of the llama.cpp build they run on.

The exactness tests check a CPU fact: ggml's CPU kernels (on the paths the engine picks) give a
sequence the same logits whatever else is in the batch, so prefix caching, batching and n > 1
never change a greedy answer. CUDA's kernels do not: on an H200 one sequence's logits moved by
up to 1.23 beside 15 others, and greedy answers parted (scripts/gpu_check.sh; README "GPU").
Some other tests time a premise that holds where the model computes on the CPU (a long prefill
takes long). Both kinds are skipped when the model computes on a GPU, with the reason.
"""
import os

import pytest

from engine.llama import gpu_offload_supported

ON_GPU = os.environ.get("PAGEDLLAMA_GPU_LAYERS", "").strip() != "0" and gpu_offload_supported()

cpu_exact = pytest.mark.skipif(
    ON_GPU, reason="exact answers are a property of ggml's CPU kernels: on a GPU a sequence's "
                   "logits depend on what decodes beside it (README, GPU)")
cpu_timing = pytest.mark.skipif(
    ON_GPU, reason="the premise is CPU speed (a long prefill, compute-bound steps); on a GPU "
                   "those steps take milliseconds (README, GPU)")
