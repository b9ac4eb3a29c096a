"""synth's fills: what each writes and what it is for (one table: synth --help and the engine read it).
No heavy import here: the command line builds its options from it at start-up."""

FILLS = {
    "random": "valid numbers (FP4 codes, E8M0 scales, finite FP8/BF16): for check-numerics, serving and benchmarks",
    "pattern": "every byte encodes its tensor and position, not finite numbers: for byte proofs (diff, a misplaced "
               "byte named); check-numerics refuses it",
}
DEFAULT_FILL = "random"
