"""sglang-pdsafe: protections for prefill/decode disaggregation.

Our own modules, hooked into upstream SGLang by the thin patches in ``patches/``.
Nothing here replaces an upstream module.
"""
