"""Integrations with training libraries. Layering is one way: kernels -> interface -> integrations.

Importing this package registers the "fpatch" attention implementation with transformers (a dict insert: cheap).
"""

from flashpatch.integrations.hf_patch import is_patched, patch_model, unpatch_model
from flashpatch.integrations.transformers import ATTN_IMPLEMENTATION, fpatch_attention_forward, register

register()

__all__ = ["ATTN_IMPLEMENTATION", "fpatch_attention_forward", "is_patched", "patch_model", "register", "unpatch_model"]
