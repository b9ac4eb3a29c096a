"""How an output is written: stream the source checkpoint once into per-rank safetensors files
(convert) and write synthetic checkpoints (synth); it imports formats/, model/, source/ and output/, never
proof/ or cli/."""
