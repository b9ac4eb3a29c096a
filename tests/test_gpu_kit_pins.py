"""tools/gpu_kit_pins.py: the GPU kit's pins from pip's resolution report, walked as uv's overrides would be."""
from __future__ import annotations


from packaging.requirements import Requirement

from helpers import script_module



def _pins():
    return script_module("tools/gpu_kit_pins.py")


def _meta(name: str, version: str, *requires: str) -> dict:
    return {"metadata": {"name": name, "version": version, "requires_dist": list(requires)}}


def test_the_walk_stops_at_the_image_and_the_left_out_and_follows_markers_and_extras():
    pins = _pins()
    report = {"install": [
        _meta("quack-kernels", "0.6.5", "torch", "nvidia-cutlass-dsl"),
        _meta("nvidia-cutlass-dsl", "4.8.0", "nvidia-cutlass-dsl-libs-base",
              "nvidia-cutlass-dsl-libs-cu13; extra == 'cu13'", "cuda-python; python_version < '3.10'"),
        _meta("nvidia-cutlass-dsl-libs-base", "4.8.0"), _meta("nvidia-cutlass-dsl-libs-cu13", "4.8.0"),
        _meta("torch", "2.14.0", "sympy"), _meta("sympy", "1.14"),  # the image's: never walked into
        _meta("Huggingface_Hub", "2.4.0", "httpx2"), _meta("httpx2", "2.17.0"),
    ]}
    roots = [Requirement("quack-kernels==0.6.5"), Requirement("nvidia-cutlass-dsl[cu13]==4.8.0"),
             Requirement("huggingface_hub>=2"), Requirement("tokenspeed-mla; platform_system == 'Windows'")]
    got = pins.closure(report, roots, {"torch", "huggingface-hub"})
    assert got == {"quack-kernels": "0.6.5", "nvidia-cutlass-dsl": "4.8.0", "nvidia-cutlass-dsl-libs-base": "4.8.0",
                   "nvidia-cutlass-dsl-libs-cu13": "4.8.0"}
    carried = pins.closure(report, roots, {"torch"})  # an image package carried anyway (--carry), with its needs
    assert carried["huggingface-hub"] == "2.4.0" and carried["httpx2"] == "2.17.0" and "sympy" not in carried
