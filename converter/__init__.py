"""lucifer-shard: offline tensor-parallel sharding of DeepSeek-V4-Flash for vLLM virtual TP.

    spec/     what the output must be, from the config alone, and the formats every side reads
      ↓
    engine/   how it is written: stream the source once into per-rank files (convert, synth)
    proof/    how it is checked, sharing no reading code with the engine (diff, verify, numerics)
      ↓
    cli/      the commands and their text/JSON rendering
    runtime_shim/ (lucifer_shard.runtime_shim)  the vLLM loader: reuses spec, never the engine
    errors.py, units.py  shared by every room

The converter never imports vllm or flashinfer; `lucifer_shard.runtime_shim` does.
"""

__version__ = "0.1.0"
