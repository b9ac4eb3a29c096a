"""lucifer-shard: offline tensor-parallel sharding of DeepSeek-V4-Flash for vLLM virtual TP.

Each folder is one room; a room imports only the rooms above it in this list (tests/test_architecture.py):

    errors.py, units.py, guarded_io.py, outnames.py   below every room
    formats/   the byte and document formats: strict JSON, records, safetensors headers, dtypes
    model/     what the output must be, from config.json alone: plan, tensor rules, layouts, arches, builds
    source/    the checkpoint that is read: on disk or on the Hub, its content fingerprint, its streaming order
    output/    the output contract: manifest, shares, the one output check, OUT's lock and read watch
    engine/    how an output is written (imports the rooms above, never proof/)
    proof/     how an output is checked (imports the rooms above, never engine/)
    cli/       the commands and their text/JSON rendering
    runtime_shim/   the vLLM plugin: reuses the rooms up to proof/, never engine/ or cli/
      errors.py, manifest.py, checks.py   what its three rooms share
      adapt/     what the plugin reads of and changes in vLLM: the judge of builds, virtual TP, the wrappers
      load/      --load-format lucifer_tp3: the load plan, the rank files read into parameters
      serving/   doctor, serve, the launch scripts (only the CLI and register() import it)

The converter never imports vllm or flashinfer; `lucifer_shard.runtime_shim` does.
"""

__version__ = "0.1.0"
