"""The axes attribution compares along: each names the one thing side B (the rollout engine) changes
relative to side A (the trainer). Data only, no torch: `parity attribute --help` lists them."""

#: axis name -> what side B changes relative to side A.
AXES: dict[str, str] = {
    "batch": "A: each sequence alone (batch size 1); B: all sequences in one right-padded batch",
    "layout": "A: all sequences in one right-padded batch; B: the same sequences packed into one row",
    "mode": "A: one packed prefill over prompt + response; B: packed decode, one response token per step",
    "dtype": "A: bfloat16; B: float16 (both: all sequences in one right-padded batch)",
}
