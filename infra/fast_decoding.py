"""Faster ``generate`` on a GPU for a whole run (``--fast-generation``): engineering, not the method.

Pass a FastDecoding as ``fast=`` to generation.recording_sampler; it samples the same tokens. With the
shared prefill (generation.prefill_once, the default) its static cache takes the prompts' rows, each
repeated G times, and the compiled decode steps run from there; the prefill stays eager either way.
"""
from __future__ import annotations

import inspect

from transformers import StaticCache


class FastDecoding:
    """Faster ``generate`` for the whole run: static KV caches, so the decode step compiles once.

    The same samples as plain ``generate``; the stored log-probs are those of the logits the
    tokens were sampled from, but compiled kernels may round differently from the training
    forward (is_ratio_mean on fresh data shows it).
    Engineering: with plain ``generate`` each decode step launches every kernel from Python (on a 0.5B model:
    24 layers, plus two small matmuls per LoRA-adapted linear), and a GPU waits on the launches.
    Given a cache of fixed shape (StaticCache) on CUDA, transformers compiles the decode step with
    torch.compile, mode "reduce-overhead": CUDA graphs replay all of a step's launches at once (the
    prefill stays eager). This object keeps one cache per batch size for the run, reset between
    rounds: a fresh cache each round would have new addresses and make torch re-record the graphs.
    Sized from the start for ``max_length`` tokens (prompt + completion), a cache only grows
    (rounded up to ``multiple``, a recompile) for a longer call. It holds batch x length keys and
    values on the device for the whole run. The LoRA weights are updated in place, so the compiled
    step sees the current policy. Not compiled: bitsandbytes 4-bit models (transformers leaves them
    eager) and a CPU, unless ``compile_config`` asks (a transformers CompileConfig with
    ``_compile_all_devices = True``); the static cache alone is slower than plain generate there.
    """

    def __init__(self, model, compile_config=None, max_length: int = 0, multiple: int = 64):
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        self.config, self.compile_config, self.multiple = base.config, compile_config, multiple
        # transformers renamed generate's cache argument (past_key_values -> cache) during 5.x
        self.cache_arg = "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"
        self.length, self.caches = 0, {}                # cache length; batch size -> its StaticCache
        self.fit(max_length)

    def fit(self, length: int) -> None:
        """Caches long enough for ``length`` tokens (prompt + completion); longer than ever: new
        caches (and a recompile). +1: on some devices (MPS) generate runs one step past the end."""
        if length + 1 > self.length:
            self.length, self.caches = -(-(length + 1) // self.multiple) * self.multiple, {}

    def generate_kwargs(self, batch_size: int, length: int) -> dict:
        """Arguments for ``generate`` of ``batch_size`` sequences of up to ``length`` tokens."""
        self.fit(length)
        cache = self.caches.get(batch_size)
        if cache is None:
            cache = self.caches[batch_size] = StaticCache(config=self.config, max_cache_len=self.length)
        else:
            cache.reset()
        return {self.cache_arg: cache}
