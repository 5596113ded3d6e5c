"""What the tests may expect of the llama.cpp build they run on.

The exactness tests check a CPU fact: ggml's CPU kernels (on the paths the engine picks) give a
sequence the same logits whatever else is in the batch, so prefix caching, batching and n > 1
never change a greedy answer. A CUDA build does not: on an H200 one sequence's logits moved by
up to 1.23 beside 15 others with every layer on the GPU, and by 1.39 with none there
(n_gpu_layers 0 in the same build), and greedy answers parted (scripts/gpu_check.sh; README
"GPU"). Some other tests time a premise that holds where the model computes on the CPU (a long
prefill takes long). Both kinds are skipped on a GPU build, with the reason.
"""
import pytest

from engine.llama import gpu_offload_supported

GPU_BUILD = gpu_offload_supported()

cpu_exact = pytest.mark.skipif(
    GPU_BUILD, reason="exact answers are a property of ggml's CPU kernels; with a GPU build a "
                      "sequence's logits depend on what decodes beside it (README, GPU)")
cpu_timing = pytest.mark.skipif(
    GPU_BUILD, reason="the premise is CPU speed (a long prefill, compute-bound steps); on a GPU "
                      "those steps take milliseconds (README, GPU)")
