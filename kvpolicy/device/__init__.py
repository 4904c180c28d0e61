"""Device memory (torch, no vLLM, no Mooncake): reading audited blocks, staging striped loads.

What runs on KV-cache tensors lives here, so that it runs and is checked on a GPU without vLLM
(``scripts/gpu_check.py``); :mod:`kvpolicy.vllm` binds it to vLLM's objects.
"""
