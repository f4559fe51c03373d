"""Speculative decoding in the worker: proposers of draft tokens, and the
rejection sampler that verifies them (the scheduler's part:
services/engine_core/spec_decode.py)."""
