"""Training speculative-decoding heads: `llmserve train-eagle` (train.py) trains an EAGLE-3 head for
a registered target on text the target generates itself, and writes it as published EAGLE-3 heads
are, for `--speculative-config '{"method": "eagle3", "model": DIR}'` (docs/spec_decode.md)."""
