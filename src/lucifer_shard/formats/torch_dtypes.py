"""The torch dtype of every safetensors dtype (dtypes.py): one table for each side that hands the bytes
to torch (synth, outdir, the vLLM loader)."""
import torch

TORCH_DTYPE = {
    "BF16": torch.bfloat16, "F32": torch.float32, "I64": torch.int64, "I32": torch.int32, "I8": torch.int8,
    "U8": torch.uint8, "F8_E4M3": torch.float8_e4m3fn, "F8_E8M0": torch.float8_e8m0fnu,
}
