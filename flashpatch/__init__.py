"""flashpatch: FlashAttention in Triton for people who train Hugging Face models.

    from flashpatch import flash_attn_func, flash_attn_varlen_func  # flash-attn 2 compatible (and the packed forms)
    from flashpatch import patch_model, unpatch_model                # one-call transformers integration
"""

from flashpatch.interface import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
)
from flashpatch.padding import cu_seqlens_from_position_ids, pad_input, unpad_input
from flashpatch.integrations import ATTN_IMPLEMENTATION, patch_model, unpatch_model  # registers "fpatch"

__version__ = "0.2.0"

__all__ = [
    "flash_attn_func",
    "flash_attn_varlen_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_varlen_kvpacked_func",
    "unpad_input",
    "pad_input",
    "cu_seqlens_from_position_ids",
    "patch_model",
    "unpatch_model",
    "ATTN_IMPLEMENTATION",
]
