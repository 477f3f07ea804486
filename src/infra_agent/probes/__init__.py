"""Probes: ``run(config, ctx) -> Feedback``, registered by short name.

Registration is lazy: the registry maps a short name to a dotted path, and the probe
module is imported only when the probe is asked for.  A dotted path
(``package.module:ClassName``) also works for probes the project does not ship.
"""

from infra_agent.probes.base import Probe, ProbeContext, get_probe, register_probe

__all__ = ["Probe", "ProbeContext", "get_probe", "register_probe"]
