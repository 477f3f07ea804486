"""Disaggregated serving: a prefill worker and a decode worker behind one front end,
the KV cache moved between them through a KV store (``refstack serve --disagg true``).

``frontend.DisaggEngine`` (the engine the server talks to), ``worker`` (the two
engines, the transfer thread, the page codec), ``kvstore`` (the store process).
"""
