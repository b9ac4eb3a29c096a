"""`--load-format lucifer_tp3`: the load plan, each rank's files checked, their tensors read into vLLM's
parameters (hashed as they land), the cross-node identity. Imports adapt/ and the shim's shared modules."""
