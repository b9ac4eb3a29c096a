"""What the output must be, from config.json alone: the config, the virtual-TP plan, the one table of tensor
rules and its expansion, the kernel layouts, the tables of arches, drafts and vLLM builds, the options, sizing.
Imports formats/ only."""
