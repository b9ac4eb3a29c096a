"""lucifer-shard: offline tensor-parallel sharding of DeepSeek-V4-Flash for vLLM virtual TP.

The converter package never imports vllm or flashinfer; `lucifer_shard.runtime_shim` does.
"""

__version__ = "0.1.0"
