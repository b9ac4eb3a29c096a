"""The `check-numerics` command (registered on the `lucifer-shard` group in group.py)."""
from __future__ import annotations

from pathlib import Path

import click

from ..errors import MismatchError
from .argorder import refuse_swapped
from .console import Console, conventions


@click.command("check-numerics")
@click.argument("out", type=click.Path(path_type=Path))
@click.argument("model", required=False)
@click.option("--layers", default=None, metavar="LIST",
              help="Layer indices, e.g. 3,4 or 0-2 or all (MTP layers by their vLLM index). "
                   "Default: the first hash-routed and the first score-routed layer.")
@click.option("--tokens", type=int, default=16, show_default=True,
              help="Random tokens per layer; routed experts read per layer are at most tokens x top-k.")
@click.option("--seed", type=int, default=0, show_default=True)
@conventions(interrupted="interrupted: check-numerics stopped before checking everything (it writes nothing); "
                         "run it again")
def check_numerics(out: Path, model: str | None, layers: str | None, tokens: int, seed: int) -> None:
    """Prove on the CPU that OUT's rank files, summed over ranks, compute what MODEL computes.

    MODEL defaults to the source the manifest records.

    \b
    Per layer, the same random activations, routing and attention output go through the
    unsharded source tensors and through every rank's tensors as written (read back through
    the manifest's inverse layout); the rank partials are summed in fp32 as the all-reduce
    would. Reported per component, relative Frobenius error vs tolerance:
      routed MoE         kernel order (BF16 after GEMM1, SwiGLU, GEMM2)   5e-3
      shared expert      FP8 block MLP, fp32 output                       1e-4
      output projection  grouped wo_a, then wo_b, fp32 output              1e-4
      virtual heads      padded heads fed non-zero input contribute       exactly 0
    Only the experts the routing picks are read, one layer at a time. Exits 1 past tolerance, and
    before any layer when OUT is damaged or edited (the manifest's self-digest, COMPLETE, a rank
    file's identity, header or size; verify reads every byte); 2 when OUT holds no output.
    """
    from ..proof.check_numerics import check_numerics as run
    from .cmd_check import DAMAGED, _fail, structure, watched

    refuse_swapped("check-numerics", model, out, model_first=False)
    con = Console.of()

    def checked():
        damage = structure(out, "check-numerics")
        if not damage.ok:
            _fail(damage, "problem(s)", DAMAGED)
        return run(out, model, layers=layers, tokens=tokens, seed=seed, progress=con.progress)

    report = watched(out, "check-numerics", checked)
    result = report.to_dict()
    result["tp_size"] = result.pop("tp")  # the key diff and inspect use
    con.emit(result, report.lines())
    if not report.ok:
        bad = [f"layer {r.layer} {r.component}" for r in report.results if not r.ok]
        raise MismatchError(f"numerics past tolerance: {', '.join(bad)}")
