"""VLA policies (a config, a model, a processor each), registered by name in :data:`POLICIES`.

Entries are lazy (``"module:SPEC"``): naming the policies (``--help``, config checks) imports no model code.
"""

from loong.core.registry import Registry
from loong.embodied.policies.base import PolicyConfig, PolicyProcessor, PolicySpec, VLAPolicy

POLICIES: Registry[PolicySpec] = Registry("policy")
POLICIES.add_lazy("pi05", "loong.embodied.policies.pi05:SPEC")
POLICIES.add_lazy("groot_n1_7", "loong.embodied.policies.groot_n1_7:SPEC")
POLICIES.add_lazy("groot_n1_6", "loong.embodied.policies.groot_n1_6:SPEC")

__all__ = ["POLICIES", "PolicyConfig", "PolicyProcessor", "PolicySpec", "VLAPolicy"]
