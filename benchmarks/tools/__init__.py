"""Measurement tooling over llama.cpp, for benchmarks/ and experiments/; the server never imports
it. `ceiling`: a bare batched llama_decode loop (the engine ceiling); `bench`: timed prefill and
decode, logits and thread settings for the experiments; `quantize`: building a quantization
ladder. Besides engine/, the only place that imports llama_cpp (tests/unit/test_layers.py)."""
