"""The inputs of the forward runs, shared by the CPU forward tests (test_forward.py) and the GPU serving
run (tests/gpu/serve_run.py): the prompts as token ids, their lengths, and the one byte flipped in a
rank file."""
from __future__ import annotations

import json
from pathlib import Path

SHORT = [[1, 17, 42, 99, 256, 512, 7, 3], [5, 900, 33, 2, 71, 640, 128, 999, 4, 12, 300, 77], [2, 3, 5, 7, 11, 13, 17]]
LONG = [[(i * 7919 + 13) % 997 + 2 for i in range(2300)]]
SHORT_STEPS, LONG_STEPS, LOGPROBS, MAX_MODEL_LEN = 8, 4, 20, 4096
# The byte flipped: in layer 0 (hash routing: token id -> experts through tid2eid, so the expert that
# the first prompt token uses is known without running the model), that expert's first w13 byte.
FLIP_TENSOR = "model.layers.0.ffn.experts.routed_experts.w13_weight"


def flip_routed_expert_byte(model: Path, out: Path, rank: int = 0) -> dict:
    """XOR 0xFF into the first byte of FLIP_TENSOR's row block, in RANK's file, of the expert that layer 0's
    hash routing gives SHORT[0][0]; returns where."""
    from safetensors import safe_open

    from lucifer_shard.formats.stheader import read_header

    index = json.loads((model / "model.safetensors.index.json").read_text())["weight_map"]
    with safe_open(str(model / index["layers.0.ffn.gate.tid2eid"]), "pt") as f:
        expert = int(f.get_tensor("layers.0.ffn.gate.tid2eid")[SHORT[0][0], 0])
    part = next(p for p in sorted((out / "target" / f"rank-{rank}").glob("*.safetensors"))
                if FLIP_TENSOR in read_header(p).tensors)
    header = read_header(part)
    t = header.tensors[FLIP_TENSOR]
    per_expert = (t.end - t.start) // t.shape[0]
    offset = header.data_start + t.start + expert * per_expert
    with open(part, "r+b") as fh:
        fh.seek(offset)
        b = fh.read(1)[0]
        fh.seek(offset)
        fh.write(bytes([b ^ 0xFF]))
    return {"file": str(part), "rank": rank, "expert": expert, "offset": offset}
