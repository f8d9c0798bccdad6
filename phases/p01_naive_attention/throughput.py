"""Phase 1 is the first rung: the baseline of phase 2's throughput checkpoint, with none of its own."""

THROUGHPUT_CHECKPOINTS: tuple = ()
