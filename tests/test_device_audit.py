"""No tensor of a training step is created on another device than its inputs' (issue: the
MoE forward made an index on the CPU while the tokens were on the GPU, which no CPU test saw).

Each case builds the real Trainer on the CPU (outside the audit), then runs one step's
forward, backward, loss, gradient reduction, norm and clipping under ``device_audit``:
there a tensor created without a device is a meta tensor, and any op mixing it with the
run's CPU tensors fails the test with the op and the line (see ``device_audit``). The
layouts cover every model piece and attention (local, Ulysses, ring, hybrid, packed), the
loss, tensor, sequence and expert parallelism, and the sub-step runner of combined 1F1B.
The optimizer's step is left out: torch's AdamW keeps its step counter on the CPU on purpose.
"""

import pytest
import torch

from device_audit import StrayDeviceError, device_audit
from hf_models import save_tiny_model, write_documents
from meshpipe.models import Transformer, TransformerConfig
from meshpipe.testing import run_distributed
from meshpipe.train.config import TrainConfig
from meshpipe.train.loop.trainer import Trainer
from trainer_cases import SMALL, for_a_model

pytestmark = pytest.mark.distributed

AUDIT = dict(SMALL, steps=1)

LAYOUTS = {
    "dense": dict(pp=1, schedule="none"),
    "recompute-full-bf16": dict(pp=1, schedule="none", recompute="full", dtype="bf16"),
    "recompute-selective-fp16": dict(pp=1, schedule="none", recompute="selective",
                                     dtype="fp16"),
    "moe-capacity": dict(pp=1, schedule="none", moe_experts=4, moe_top_k=2,
                         moe_capacity_factor=1.0),
    "moe-combined-1f1b": dict(pp=1, moe_experts=4, moe_top_k=2, schedule="combined-1f1b"),
    "pp2-zb-v-tied": dict(pp=2, vpp=2, schedule="zb-v", tie_embeddings=True),
    "ring2": dict(pp=1, schedule="none", cp_ring=2),
    "ulysses2": dict(pp=1, schedule="none", cp_ulysses=2),
    "tp2-sequence-parallel": dict(pp=1, schedule="none", tp=2, sequence_parallel=True),
    "ep2-dp2": dict(pp=1, schedule="none", dp=2, moe_experts=4, moe_top_k=2, ep=2),
    "ep2-cp-ring2-combined-1f1b": dict(pp=1, cp_ring=2, moe_experts=4, ep=2,
                                       schedule="combined-1f1b"),
    "pp2-stage-tp-2-1": dict(pp=2, stage_tp="2,1"),
    "hybrid2x2": dict(pp=1, schedule="none", cp_ring=2, cp_ulysses=2),
}
PACKED = {
    "packed-local": dict(pp=1, schedule="none"),
    "packed-ring2": dict(pp=1, schedule="none", cp_ring=2),
    "packed-hybrid2x2": dict(pp=1, schedule="none", cp_ring=2, cp_ulysses=2),
}


def _audited_step(rank, world_size, config):
    trainer = Trainer(config)
    with device_audit():
        inputs, targets = trainer.microbatches(trainer.train_data, 0)
        result = trainer.executor.step(inputs, targets)
        trainer.experts.metrics()
        trainer.gradients.reduce()
        norm = trainer.gradients.norm()
        trainer.gradients.clip(norm)
    return result.loss, norm


def _assert_clean_step(config):
    for loss, norm in run_distributed(config.world_size, _audited_step, config):
        assert norm > 0 and (loss is None or loss > 0)


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_a_training_step_creates_every_tensor_on_its_inputs_device(layout):
    _assert_clean_step(TrainConfig(**{**AUDIT, **layout}))


@pytest.mark.parametrize("layout", PACKED.values(), ids=PACKED.keys())
def test_a_packed_training_step_creates_every_tensor_on_its_inputs_device(tmp_path, layout):
    data = write_documents(tmp_path / "docs.txt", max_words=4)
    _assert_clean_step(TrainConfig(**{**AUDIT, **layout}, data=str(data), pack=True,
                                   out_dir=str(tmp_path)))


@pytest.mark.parametrize("layout", [dict(pp=2), dict(pp=1, schedule="none", cp_ring=2)],
                         ids=["pp2", "ring2"])
def test_a_hugging_face_models_step_creates_every_tensor_on_its_inputs_device(tmp_path,
                                                                             layout):
    pytest.importorskip("transformers")
    directory = save_tiny_model(tmp_path / "model", "llama")
    hf = for_a_model(AUDIT)
    _assert_clean_step(TrainConfig(**hf, **layout, model=str(directory),
                                   out_dir=str(tmp_path)))


def test_the_audit_names_a_tensor_created_without_a_device():
    model = Transformer(TransformerConfig(vocab_size=64, dim=16, n_layers=1, n_heads=2,
                                          n_kv_heads=1, max_seq_len=16))
    tokens = torch.randint(0, 64, (1, 8))
    with device_audit(), pytest.raises(StrayDeviceError, match="test_device_audit.py"):
        model(tokens) + torch.ones(64)
