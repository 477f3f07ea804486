"""The ``infra-agent`` command line: one verb per job, each with ``--json``."""
