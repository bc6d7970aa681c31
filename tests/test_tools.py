"""tools/host_ab.py's copy of a revision as the package `flashpatch_base`: every import and the custom-op namespace
renamed, nothing else (what it then times needs a GPU)."""

import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))
import host_ab  # noqa: E402


def test_rename_package_moves_imports_and_the_op_namespace_only():
    text = ('"""flashpatch kernels, as flashpatch.ops says."""\n'
            "import flashpatch\n"
            "import flashpatch.kernels.launch as launch\n"
            "from flashpatch import ops, padding\n"
            "from flashpatch.integrations.hf_masks import fpatch_mask\n"
            'attn_fwd = torch.library.custom_op("flashpatch::attn_fwd", impl)\n'
            "out = torch.ops.flashpatch.attn_fwd(q)\n")
    assert host_ab.rename_package(text) == (
        '"""flashpatch kernels, as flashpatch.ops says."""\n'
        "import flashpatch_base\n"
        "import flashpatch_base.kernels.launch as launch\n"
        "from flashpatch_base import ops, padding\n"
        "from flashpatch_base.integrations.hf_masks import fpatch_mask\n"
        'attn_fwd = torch.library.custom_op("flashpatch_base::attn_fwd", impl)\n'
        "out = torch.ops.flashpatch_base.attn_fwd(q)\n")


def test_rename_package_leaves_no_import_of_this_checkout_in_the_package():
    # the package as it is now, renamed: no line still imports flashpatch (base_package refuses such a copy)
    for path in (REPO / "flashpatch").rglob("*.py"):
        renamed = host_ab.rename_package(path.read_text())
        assert not re.search(r"^\s*(from|import) flashpatch\b(?!_)", renamed, re.MULTILINE), path
        assert "torch.ops.flashpatch." not in renamed and '"flashpatch::' not in renamed, path
