"""Speculative engine: KV cache, scheduler, target runner, one worker per algorithm."""
