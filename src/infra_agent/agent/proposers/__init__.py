"""Proposers: ``rules``, ``search`` and ``llm`` (see ``base.Proposer``)."""
