"""What the plugin reads of and changes in vLLM: the judge of a live build against the build table, vLLM's
config read, the Lucifer tuple, the refused settings, stock virtual TP and the wrappers. Imports the shim's
shared modules only."""
