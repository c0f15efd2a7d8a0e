"""Test-only stand-in for vLLM, on PYTHONPATH of the SGLang servers the e2e tests start: SGLang's
non-CUDA RotaryEmbedding imports ``vllm._custom_ops.rotary_embedding``, and vLLM on PyPI is CUDA-only.
Nothing else of vLLM is provided."""
