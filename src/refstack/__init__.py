"""refstack: the reference hybrid-attention inference stack.

A compact but real serving engine around a hybrid model (KDA linear attention,
grouped-query full attention, MoE MLPs) built from its own config with seeded
random weights, so it runs anywhere, a CPU included, without downloads.
"""
