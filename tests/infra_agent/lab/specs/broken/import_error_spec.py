from __future__ import annotations

import torch

from infra_agent.lab.spec import KernelSpec

raise RuntimeError("cannot build the kernel module")  # simulated: a compile step fails at import
