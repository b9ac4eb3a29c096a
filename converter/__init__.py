"""lucifer-shard: offline tensor-parallel sharding of DeepSeek-V4-Flash for vLLM virtual TP.

    lucifer_shard (converter/)
      errors.py, units.py   shared by every room
      spec/     imports no room      what the output must be, from the config alone; what every side reads
      engine/   imports spec         how it is written: the source streamed once into per-rank files
      proof/    imports spec         how it is checked, sharing no reading code with the engine
      cli/      imports every room   the commands and their text/JSON rendering
    lucifer_shard.runtime_shim (runtime_shim/)   the vLLM loader: reuses spec (and proof), never engine or cli

The converter never imports vllm or flashinfer; `lucifer_shard.runtime_shim` does.
"""

__version__ = "0.1.0"
