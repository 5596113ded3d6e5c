"""What the tests may expect of the llama.cpp build they run on.

The exactness tests check a CPU fact: ggml's CPU kernels (on the paths the engine picks) give a
sequence the same logits whatever else is in the batch, so prefix caching, batching and n > 1
never change a greedy answer. A CUDA build does not: on an H200 one sequence's logits moved by
up to 1.23 beside 15 others with every layer on the GPU (scripts/gpu_check.sh; docs/gpu.md).
With PAGEDLLAMA_GPU_LAYERS=0 the models stay on the CPU, llama.cpp's op offload included
(engine.llama.Context), and the exactness tests run there too (on an H100: 0 apart; with the
op offload on, 1.39). Some other tests time a premise that holds where the model computes on
the CPU (a long prefill takes long); they are skipped on any GPU build.
"""
import pytest

from engine.model import gpu_offload_supported
from server.config import gpu_layers_from_env

GPU_BUILD = gpu_offload_supported()
# n_gpu_layers for a Model a test loads itself: what the test servers get (PAGEDLLAMA_GPU_LAYERS)
TEST_GPU_LAYERS = gpu_layers_from_env()
# the tests' models on the GPU: a GPU build's default, unless PAGEDLLAMA_GPU_LAYERS=0
ON_GPU = GPU_BUILD and TEST_GPU_LAYERS != 0

cpu_exact = pytest.mark.skipif(
    ON_GPU, reason="exact answers are a property of ggml's CPU kernels; on the GPU a sequence's "
                   "logits depend on what decodes beside it (docs/gpu.md)")
cpu_timing = pytest.mark.skipif(
    GPU_BUILD, reason="the premise is CPU speed (a long prefill, compute-bound steps); on a GPU "
                      "those steps take milliseconds (docs/gpu.md)")
