"""Hugging Face decoders' norms with Llama's formula as one ``rms_norm`` call
(``meshpipe.models.hf_norms``): every architecture's, against transformers' own forward."""

from __future__ import annotations

import pytest
import torch

from hf_models import ARCHITECTURES, VISION_ARCHITECTURES, save_tiny_model, save_tiny_vision_model
from meshpipe.models import hf, hf_norms
from meshpipe.models.transformer import RMSNorm

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(not RMSNorm.torch_computes_in_float32,
                                reason="this torch's rms_norm rounds before the gain")


def _skeleton(tmp_path, arch):
    if arch in VISION_ARCHITECTURES:
        return hf.build_skeleton(save_tiny_vision_model(tmp_path / arch, arch))
    return hf.build_skeleton(save_tiny_model(tmp_path / arch, arch))


@pytest.mark.parametrize("arch", ARCHITECTURES + VISION_ARCHITECTURES)
def test_every_norm_with_llamas_formula_is_one_call_with_transformers_values(tmp_path, arch,
                                                                            monkeypatch):
    """In float32 the values of transformers' formula; in bf16 within its one rounding more.
    Gemma's norms (``1 + weight``) keep transformers' forward."""
    import torch.nn.functional as F

    norms = [m for m in _skeleton(tmp_path, arch).modules()
             if type(m).__name__.endswith("RMSNorm")]
    fused = [m for m in norms if type(m).__name__.startswith("Fused")]
    assert norms and len(fused) == (0 if arch.startswith("gemma") else len(norms))
    calls = []
    rms_norm = F.rms_norm
    monkeypatch.setattr(F, "rms_norm", lambda *args: calls.append(1) or rms_norm(*args))
    for norm in fused:
        original = type(norm).__mro__[1]
        assert original.__name__ in hf_norms.LLAMA_FORMULA and isinstance(norm, original)
        norm.to_empty(device="cpu")
        with torch.no_grad():
            norm.weight.normal_(1.0, 0.2)
        for dtype, tolerance in ((torch.float32, {}),
                                 (torch.bfloat16, dict(rtol=1.6e-2, atol=1e-2))):
            norm.to(dtype)
            x = torch.randn(2, 5, norm.weight.shape[0]).to(dtype)
            calls.clear()
            got = norm(x)
            assert calls == [1]
            torch.testing.assert_close(got, original.forward(norm, x), **tolerance)


def test_a_norm_given_another_dtype_than_its_weight_keeps_transformers_forward(tmp_path):
    """transformers promotes to the weight's dtype (fp16 autocast on float32 weights)."""
    norm = next(m for m in _skeleton(tmp_path, "llama").modules()
                if type(m).__name__ == "FusedLlamaRMSNorm")
    norm.to_empty(device="cpu")
    with torch.no_grad():
        norm.weight.fill_(1.5)
    x = torch.randn(3, norm.weight.shape[0], dtype=torch.bfloat16)
    got = norm(x)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, type(norm).__mro__[1].forward(norm, x), rtol=0, atol=0)
