"""Chat-model plumbing that is not a proposer: the deterministic stand-in server.

``standin.serve_standin(script)`` serves an OpenAI-compatible chat endpoint that
replays a script (:mod:`infra_agent.standin.script`): for tests, and for trying the
``llm`` proposer without a model.  It is a stand-in, not a model.
"""
