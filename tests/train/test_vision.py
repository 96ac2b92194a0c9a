"""Vision-language models (Qwen2-VL, Qwen2.5-VL) through the pipeline: --check against the
unmodified transformers model with 0-3 images of mixed sizes per sample, packed and not,
with data parallelism and the sharded optimizer; captions and chats with images in the
cache, their images files or bytes in Parquet and save_to_disk columns; each microbatch at
its own length; bad input refused in one line."""

import json

import numpy as np
import pytest
import torch

from hf_models import save_tiny_vision_model
from meshpipe.testing import run_distributed
from meshpipe.train.config import TrainConfig
from meshpipe.train.data.shapes import write_shapes_corpus
from meshpipe.train.run import data_sources, sources
from trainer_cases import SMALL, check_first_step, for_a_model

pytest.importorskip("transformers")

VISION = dict(SMALL, seq_len=64, microbatches=2, steps=2)


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    return write_shapes_corpus(tmp_path_factory.mktemp("shapes"), 40)


# (architecture, its tiny config's overrides): LLaVA with a CLIP tower that drops its class
# token, and with a SigLIP one that keeps every patch.
MODELS = {"qwen2_vl": ("qwen2_vl", {}), "qwen2_5_vl": ("qwen2_5_vl", {}),
          "llava-clip": ("llava", {}),
          "llava-siglip": ("llava", dict(tower="siglip_vision_model", strategy="full"))}


@pytest.fixture(scope="module", params=list(MODELS))
def vision_model(request, tmp_path_factory):
    arch, overrides = MODELS[request.param]
    return save_tiny_vision_model(tmp_path_factory.mktemp(request.param), arch, **overrides)


def vision_config(model, data, tmp_path, **flags):
    """``data``: a path, or a tuple of PATH:WEIGHT sources."""
    return TrainConfig(**{**for_a_model(VISION), "pp": 2, "model": str(model),
                          "data": data if isinstance(data, tuple) else str(data),
                          "out_dir": str(tmp_path), **flags})


@pytest.mark.distributed
@pytest.mark.parametrize("flags", [dict(), dict(pack=True)], ids=["unpacked", "packed"])
def test_check_passes_with_the_tower_on_the_first_stage(vision_model, shapes, tmp_path, flags):
    config = vision_config(vision_model, shapes, tmp_path, **flags)
    report = run_distributed(config.world_size, check_first_step, config)[0]
    assert report["mismatched"] == [] and report["passed"], report
    assert report["loss_difference"] < 1e-5


def test_the_first_batch_shows_images_of_several_sizes_and_the_tower_costs_layers(
        vision_model, shapes, tmp_path):
    """What the --check tests above rest on: images of mixed sizes in the first batch (LLaVA's
    processors make them one size), several images in a sample; and the split gives the
    first stage, which carries the tower, no more layers than the others."""
    from meshpipe.train.run.plan import build_schedule, layers_per_stage

    config = vision_config(vision_model, shapes, tmp_path)
    sources.check_sources(config)
    batch = data_sources.samplers(config, 0)[0].batch(0)
    grids = {tuple(g) for row in batch.pictures for piece in row for g in piece.grids.tolist()}
    assert len(grids) >= (1 if "llava" in vision_model.name else 2)
    assert max(len(piece.grids) for row in batch.pictures for piece in row) >= 2
    assert sources.tower_cost(config) > 0
    layers = layers_per_stage(config, build_schedule(config))
    assert sum(layers) == 4 and layers[0] <= layers[1]


@pytest.mark.distributed
def test_check_passes_under_data_parallelism_with_the_sharded_optimizer(shapes, tmp_path):
    """Qwen2.5-VL at pp 2 x dp 2 with --zero 1: each replica its own images (a replica's
    microbatches may have none and still join the tower's gradient reduction)."""
    model = save_tiny_vision_model(tmp_path / "model", "qwen2_5_vl")
    config = vision_config(model, shapes, tmp_path, dp=2, zero=1)
    report = run_distributed(config.world_size, check_first_step, config)[0]
    assert report["mismatched"] == [] and report["passed"], report


def chat_rows(path):
    """Conversations whose user turns show images: the loss belongs on the answers."""
    rows = [{"messages": [
        {"role": "user", "content": [{"type": "image", "image": "shape-1-0.png"},
                                     {"type": "text", "text": "what is it?"}]},
        {"role": "assistant", "content": "a shape"}]},
        {"messages": [{"role": "user", "content": "no picture here"},
                      {"role": "assistant", "content": "fine"}]}]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def test_chats_with_images_train_only_the_answers(vision_model, shapes, tmp_path):
    """A chat row's image becomes its tokens (the processor's count), never targets; of the
    text only the assistant's tokens are."""
    chats = chat_rows(shapes.parent / "chats.jsonl")
    config = vision_config(vision_model, chats, tmp_path)
    data = data_sources.tokenized(config, str(chats))
    inputs = data_sources.image_inputs(config)
    grids = data.images.grids
    assert list(data.images.image_offsets) == [0, 1, 1]
    first = np.asarray(data.tokens[:data.offsets[1]])
    shown = int((first == inputs.image_token_id).sum())
    assert shown == int(inputs.tokens_per_image(grids)[0]) > 1
    words = data_sources.tokenizer(config)
    for document in range(2):
        span = slice(int(data.offsets[document]), int(data.offsets[document + 1]))
        trained = np.asarray(data.tokens[span])[np.asarray(data.mask[span]) == 1]
        text = words._tokenizer.decode(trained.tolist())
        assert text.strip().startswith(("a shape", "fine")), text


def write_rows(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


UNSHOWN = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what?"}]},
           {"role": "assistant", "content": "a shape"}]
BAD_ROWS = {"missing image": [{"images": ["nowhere.png"], "text": "a"}],
            "unreadable image": [{"images": ["broken.png"], "text": "a"}],
            "image bytes that are no image": [{"images": [{"bytes": b"not a png",
                                                           "path": None}], "text": "a"}],
            "an image that is a number": [{"images": [3], "text": "a"}],
            "an image part without its image": [{"messages": UNSHOWN}],
            "images past seq-len": [{"images": ["shape-1-0.png"] * 3, "text": "a"}],
            "images without a vision model": [{"images": ["shape-1-0.png"], "text": "a"}]}
# What the one line says: the row's place, then why.
BAD_ROW_LINES = {"missing image": ("line 1", "does not exist"),
                 "unreadable image": ("line 1", "cannot read image"),
                 "image bytes that are no image": ("row 0", "cannot read image 1 of the row "
                                                            "(9 bytes)"),
                 "an image that is a number": ("line 1", "an image must be a file path"),
                 "an image part without its image": ("line 1", "show 1 images that name no "
                                                               "file and its \"images\" holds 0"),
                 "images past seq-len": ("line 1", "past --seq-len 16"),
                 "images without a vision model": ("line 1", "vision-language --model")}


@pytest.mark.parametrize("case", list(BAD_ROWS))
def test_bad_image_data_is_refused_in_one_line(vision_model, shapes, tmp_path, case):
    folder = shapes.parent
    (folder / "broken.png").write_bytes(b"not a png")
    name = folder / f"bad-{case.replace(' ', '-')}"
    if case == "image bytes that are no image":
        pa = pytest.importorskip("pyarrow")
        parquet = pytest.importorskip("pyarrow.parquet")
        data = name.with_suffix(".parquet")
        parquet.write_table(pa.Table.from_pylist(BAD_ROWS[case]), data)
    else:
        data = write_rows(name.with_suffix(".jsonl"), BAD_ROWS[case])
    flags = dict(seq_len=16) if case == "images past seq-len" else {}
    config = vision_config(vision_model, data, tmp_path, **flags)
    if case == "images without a vision model":
        config = TrainConfig(**{**vars(config), "model": "", "pp": 1,
                                "tokenizer": str(vision_model)})
    with pytest.raises(ValueError) as raised:
        sources.check_sources(config)
    message = str(raised.value)
    assert "\n" not in message
    assert all(part in message for part in BAD_ROW_LINES[case]), message


def test_bad_models_and_layouts_are_refused_in_one_line(vision_model, shapes, tmp_path):
    from meshpipe.models import hf

    bare = tmp_path / "noproc"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        (bare / name).write_bytes((vision_model / name).read_bytes())
    with pytest.raises(ValueError, match="without its image processor"):
        hf.inspect_model(bare)
    config_file = bare / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()),
                                       "model_type": "idefics9"}))
    with pytest.raises(ValueError, match="vision-language ones: qwen2_vl, qwen2_5_vl, llava"):
        hf.inspect_model(bare)


def boundary_bytes(rank, world_size, config):
    """Stage 0's activation bytes sent in one step, and the bytes its microbatches' real
    tokens make (hidden states, 4 bytes a value, and the 3D positions, 8 bytes each)."""
    from meshpipe.train.loop.trainer import Trainer

    trainer = Trainer(config)
    stats = trainer.executor.transport.stats
    stats.reset()
    trainer.train_step(0)
    if rank != 0:
        return None
    batch = trainer.train_data.batch(0)
    real = sum(batch.lengths)
    from meshpipe.models import hf

    dim = hf.decoder_config(hf.load_config(config.model)).hidden_size
    return stats.payload_bytes_sent, real * (dim * 4 + 3 * 8)


@pytest.mark.distributed
def test_each_microbatch_crosses_the_boundary_at_its_own_length(shapes, tmp_path):
    """No padding to --seq-len: one sequence a microbatch, what stage 0 sends is within 5 %
    of the bytes of the sequences' real tokens (a sample is a quarter of --seq-len or so)."""
    model = save_tiny_vision_model(tmp_path / "model", "qwen2_vl")
    config = vision_config(model, shapes, tmp_path, seq_len=256, microbatches=4,
                           microbatch_size=1)
    sent, real = run_distributed(config.world_size, boundary_bytes, config)[0]
    print(f"stage 0 sent {sent} bytes for {real} bytes of real tokens ({sent / real:.4f})")
    assert real <= sent <= 1.05 * real, (sent, real)
    assert sent < 0.5 * 4 * 256 * (32 * 4 + 3 * 8)


def test_an_export_loads_back_with_the_same_logits(vision_model, shapes, tmp_path):
    """The trained weights under the files' names: transformers' AutoModelForImageTextToText
    loads the exported directory and gives meshpipe's logits on a batch with images."""
    import transformers

    from meshpipe.models import hf, hf_export, hf_vision
    from meshpipe.models.vision_positions import mrope_positions
    from meshpipe.train.data.images import Pictures

    skeleton = hf.build_skeleton(vision_model)
    info = hf.inspect_model(vision_model).vision
    chunks = hf_vision.split_vision_model(skeleton, hf.split_model(skeleton, [1, 3]),
                                          info.image_token_id)
    names = hf.full_names(skeleton)
    real = hf.materialize(skeleton, chunks, vision_model)
    state = {names[meta]: param for meta, param in real.items()}
    expected = {"qwen": ("visual.patch_embed.proj.weight", "model.layers.0.mlp.up_proj.weight"),
                "llava": ("vision_tower.embeddings.patch_embedding.weight",
                          "language_model.model.layers.0.mlp.up_proj.weight",
                          "multi_modal_projector.linear_1.weight")}
    assert all(name in state for name in expected["llava" if "llava" in vision_model.name
                                                   else "qwen"])
    with torch.no_grad():
        for param in state.values():
            param.add_(torch.randn_like(param) * 0.01)  # "trained"
    exported = hf_export.export_model(state, vision_model, tmp_path / "export")
    config = vision_config(vision_model, shapes, tmp_path)
    batch = data_sources.samplers(config, 0)[0].batch(0)
    shown = Pictures.joined([piece for row in batch.pictures for piece in row],
                            batch.pictures[0][0].pixels.shape[1])
    rope = mrope_positions(batch.tokens, shown.grids, info.image_token_id,
                           info.merge_size) if info.rope_3d else None
    upstream = transformers.AutoModelForImageTextToText.from_pretrained(str(exported),
                                                                        dtype=torch.float32)
    images = hf_vision.reference_images(info.model_type, shown.pixels, shown.grids,
                                        upstream.config)
    if info.rope_3d:
        images["mm_token_type_ids"] = (batch.tokens == info.image_token_id).int()
    with torch.no_grad():
        ours = chunks[1](*chunks[0](batch.tokens, None, None, rope, shown.pixels, shown.grids))
        theirs = upstream(input_ids=batch.tokens, **images).logits
    torch.testing.assert_close(theirs, ours)
    assert (exported / "preprocessor_config.json").is_file()


@pytest.mark.distributed
@pytest.mark.parametrize("schedule,flags", [("interleaved", dict(vpp=2)), ("zb-h1", {})])
def test_check_passes_under_other_schedules(shapes, tmp_path, schedule, flags):
    """Interleaved 1F1B over 4 stages (the tower's stage with no decoder layer or one) and
    ZB-H1's split backward, on the tower too."""
    model = save_tiny_vision_model(tmp_path / "model", "qwen2_vl")
    config = vision_config(model, shapes, tmp_path, schedule=schedule,
                           microbatches=4, **flags)
    report = run_distributed(config.world_size, check_first_step, config)[0]
    assert report["mismatched"] == [] and report["passed"], report


@pytest.mark.distributed
def test_text_only_data_and_bf16_train_a_vision_language_model(shapes, tmp_path):
    """Data without a single image (a .txt) runs through the tower's stage; and a bf16 run
    with images passes --check at bf16's tolerance."""
    from hf_models import write_documents

    model = save_tiny_vision_model(tmp_path / "model", "qwen2_vl")
    text = write_documents(tmp_path / "docs.txt")
    for data, flags in ((text, {}), (shapes, dict(dtype="bf16"))):
        config = vision_config(model, data, tmp_path / str(len(flags)), **flags)
        report = run_distributed(config.world_size, check_first_step, config)[0]
        assert report["mismatched"] == [] and report["passed"], (flags, report)


def test_stage_layers_places_the_layers_as_given(vision_model, shapes, tmp_path):
    from meshpipe.train.run.plan import build_schedule, layers_per_stage

    def layers(text, **flags):
        config = vision_config(vision_model, shapes, tmp_path, stage_layers=text, **flags)
        return layers_per_stage(config, build_schedule(config))

    assert layers("vision+3,1") == [3, 1]
    assert layers("vision,4") == [0, 4]
    assert layers("vision,1,1,2", vpp=2, schedule="interleaved", microbatches=4) == [0, 1, 1, 2]
    for bad, message in (("vision+2,1", "all 4 layers"), ("2,x", "not a list of layer counts"),
                         ("4", "each of the 2 stages")):
        with pytest.raises(ValueError, match=message):
            layers(bad)
    reference = TrainConfig(pp=2, layers=4, stage_layers="vision+2,2")
    with pytest.raises(ValueError, match="names a vision tower, which the model has not"):
        layers_per_stage(reference, build_schedule(reference))
    plain = TrainConfig(pp=2, layers=4, stage_layers="1,3")
    assert layers_per_stage(plain, build_schedule(plain)) == [1, 3]


@pytest.mark.distributed
def test_check_passes_with_the_tower_on_a_stage_of_its_own(shapes, tmp_path):
    model = save_tiny_vision_model(tmp_path / "model", "qwen2_vl")
    config = vision_config(model, shapes, tmp_path, stage_layers="vision,4")
    report = run_distributed(config.world_size, check_first_step, config)[0]
    assert report["mismatched"] == [] and report["passed"], report


@pytest.mark.distributed
@pytest.mark.parametrize("flags", [dict(freeze="vision,projector", stage_layers="vision,4"),
                                   dict(freeze="vision,language")],
                         ids=["tower-frozen-on-its-own-stage", "only-the-projector-trains"])
def test_check_passes_with_frozen_parts(shapes, tmp_path, flags):
    """The frozen tower alone with the embedding on stage 0; and a run in which only the
    projector trains, so that stage 1 (decoder layers and head) has no weight to train and
    still passes the gradients back."""
    model = save_tiny_vision_model(tmp_path / "model", "qwen2_vl")
    config = vision_config(model, shapes, tmp_path, **flags)
    report = run_distributed(config.world_size, check_first_step, config)[0]
    assert report["mismatched"] == [] and report["passed"], report


def one_step_and_its_checkpoint(rank, world_size, config):
    """Every weight before and after one training step (rank 0's stages), and the names of
    the checkpoint's optimizer entries."""
    from meshpipe.train.checkpoints.store import read_tensors
    from meshpipe.train.loop.trainer import Trainer

    trainer = Trainer(config)
    before = {name: p.detach().clone() for name, p in trainer.parameters}
    trainer.train_step(0)
    trainer.checkpointer.save(1)
    after = {name: p.detach().clone() for name, p in trainer.parameters}
    if rank != 0:
        return None
    from pathlib import Path

    saved = read_tensors(next((Path(config.out_dir) / "checkpoint").glob("step-*")), "optim.")
    return before, after, sorted(saved)


@pytest.mark.distributed
def test_frozen_parts_stay_and_keep_no_optimizer_state_and_lr_scale_scales(shapes, tmp_path):
    """--freeze vision: the tower's weights are unchanged after a step and the checkpoint
    holds no optimizer state for them; --lr-scale projector=0.5: AdamW's first update of the
    projector is half as large as the decoder's (each of its first steps is the rate)."""
    model = save_tiny_vision_model(tmp_path / "model", "qwen2_vl")
    config = vision_config(model, shapes, tmp_path, freeze="vision",
                           lr_scale="projector=0.5", weight_decay=0.0, warmup_steps=0)
    before, after, saved = run_distributed(config.world_size, one_step_and_its_checkpoint,
                                           config)[0]
    tower = [name for name in before if name.startswith("visual.") and "merger" not in name]
    assert tower and all(torch.equal(before[name], after[name]) for name in tower)
    assert not [key for key in saved if key.startswith("optim.visual.blocks")]
    assert any(key.startswith("optim.visual.merger") for key in saved)
    largest = {part: max(float((after[n] - before[n]).abs().max()) for n in before
                         if n.startswith(prefix))
               for part, prefix in (("projector", "visual.merger."), ("language", "model."))}
    assert largest["projector"] == pytest.approx(0.5 * largest["language"], rel=0.05)


def test_the_tp_ranks_share_the_images_out_in_order_by_their_patches():
    from meshpipe.models.hf_vision import image_share

    assert [image_share([4, 4, 4, 4], rank, 2) for rank in range(2)] == [(0, 2), (2, 4)]
    assert [image_share([16, 1, 1], rank, 2) for rank in range(2)] == [(0, 1), (1, 3)]
    assert [image_share([9], rank, 2) for rank in range(2)] == [(0, 0), (0, 1)]
    assert image_share([], 0, 2) == (0, 0)
    generator = np.random.default_rng(0)
    for _ in range(200):
        patches = generator.integers(1, 50, size=generator.integers(1, 12)).tolist()
        size = int(generator.integers(1, 5))
        shares = [image_share(patches, rank, size) for rank in range(size)]
        taken = [index for first, last in shares for index in range(first, last)]
        assert taken == list(range(len(patches)))  # every image once, in order
        most = max(sum(patches[first:last]) for first, last in shares)
        assert most <= sum(patches) / size + max(patches)  # within an image of even


def tower_patches(rank, world_size, config):
    """The patches this rank's tower ran on in the first step's --check, and the report."""
    from meshpipe.models.hf_vision import VisionChunk
    from meshpipe.train.loop.trainer import Trainer

    trainer = Trainer(config)
    seen = []
    for stage in trainer.stages.values():
        for module in stage.module.modules():
            if isinstance(module, VisionChunk) and module.tower is not None:
                run = module.tower.forward
                module.tower.forward = lambda pixels, grids, run=run: (
                    seen.append(pixels.shape[0]) or run(pixels, grids))
    report = trainer.check_first_step()
    return sum(seen), report


@pytest.mark.distributed
@pytest.mark.parametrize("flags", [dict(tp=2), dict(cp_ring=2, pack=True),
                                   pytest.param(dict(tp=2, cp_ulysses=2),
                                                marks=pytest.mark.slow)],
                         ids=["tp", "ring-packed", "tp-ulysses"])
def test_each_rank_runs_the_tower_on_its_share_of_the_images(shapes, tmp_path, flags):
    """Qwen2-VL over tp and context-parallel ranks: their towers together see each image of
    the step once, each rank some, and the step equals one process's."""
    model = save_tiny_vision_model(tmp_path / "model", "qwen2_vl")
    config = vision_config(model, shapes, tmp_path, pp=1, **flags)
    sources.check_sources(config)
    batch = data_sources.samplers(config, 0)[0].batch(0)
    patches = sum(piece.pixels.shape[0] for row in batch.pictures for piece in row)
    results = run_distributed(config.world_size, tower_patches, config)
    shares = [seen for seen, _ in results]
    assert sum(shares) == patches and min(shares) > 0, (shares, patches)
    report = results[0][1]
    assert report["mismatched"] == [] and report["passed"], report


def test_under_sequence_parallelism_a_microbatch_is_a_multiple_of_tp_long(shapes, tmp_path):
    """Cut to its longest sequence, a microbatch is then rounded up to a multiple of the tp
    size, which sequence parallelism splits its columns over."""
    from meshpipe.train.loop.batches import RankBatches

    model = save_tiny_vision_model(tmp_path / "model", "qwen2_vl")
    config = vision_config(model, shapes, tmp_path, tp=2, sequence_parallel=True, seq_len=256)
    sources.check_sources(config)
    sampler = data_sources.samplers(config, 0)[0]
    batches = RankBatches(config, 0, 0, torch.device("cpu"))
    longest = []
    for step in range(6):
        batch = sampler.batch(step)
        for index, inputs in enumerate(batches(sampler, step).inputs):
            size = config.microbatch_size
            longest.append(max(batch.lengths[index * size:(index + 1) * size]))
            assert inputs[0].shape[1] == longest[-1] + longest[-1] % 2
    assert any(length % 2 for length in longest) and max(longest) < config.seq_len


@pytest.mark.distributed
@pytest.mark.parametrize("arch,flags", [
    ("qwen2_vl", dict()), ("qwen2_vl", dict(sequence_parallel=True, seq_len=128, seed=1)),
    pytest.param("llava", dict(sequence_parallel=True), marks=pytest.mark.slow),
    pytest.param("qwen2_vl", dict(sequence_parallel=True, cp_ulysses=2, pp=1),
                 marks=pytest.mark.slow)],
    ids=["tp", "sequence-parallel", "llava-sequence-parallel", "ulysses-sequence-parallel"])
def test_check_passes_with_tensor_parallelism_on_the_decoder(shapes, tmp_path, arch, flags):
    """A vision-language model at pp 2 x tp 2: the decoder split over the tp ranks, the
    tower whole on each (its gradient is then whole on each too); with sequence parallelism
    the first stage places the image features over the whole sequence, then each rank keeps
    its shard (each microbatch's length a multiple of tp)."""
    model = save_tiny_vision_model(tmp_path / "model", arch)
    config = vision_config(model, shapes, tmp_path, tp=2, **flags)
    report = run_distributed(config.world_size, check_first_step, config)[0]
    assert report["mismatched"] == [] and report["passed"], report


@pytest.mark.distributed
@pytest.mark.parametrize("arch,flags", [("llava", dict(cp_ring=2, pack=True)),
                                        ("qwen2_vl", dict(cp_ring=2, pack=True)),
                                        ("qwen2_vl", dict(cp_ring=2, pack=True,
                                                          microbatch_size=1)),
                                        ("qwen2_vl", dict(cp_ulysses=2)),
                                        pytest.param("qwen2_vl", dict(cp_ring=2, cp_ulysses=2,
                                                                      pack=True),
                                                     marks=pytest.mark.slow)],
                         ids=["llava-ring-packed", "ring-packed", "ring-packed-one-image",
                              "ulysses", "hybrid-packed"])
def test_check_passes_with_context_parallelism(shapes, tmp_path, arch, flags):
    """The decoder's sequence over the context-parallel ranks (with Qwen2-VL's 3D
    positions): each rank its (zigzag) columns of the tokens, their positions and image
    features. At one sample a microbatch the first step's second microbatch shows one
    image, so one rank runs no tower and still joins the features' gradient sum."""
    model = save_tiny_vision_model(tmp_path / "model", arch)
    config = vision_config(model, shapes, tmp_path, **flags)
    report = run_distributed(config.world_size, check_first_step, config)[0]
    assert report["mismatched"] == [] and report["passed"], report


def compiled_check(rank, world_size, config):
    """--check with the decoder blocks compiled by ``aot_eager`` (TorchDynamo's capture and
    AOTAutograd, without generating code)."""
    import os

    from meshpipe.models.compile import BACKEND_VARIABLE

    os.environ[BACKEND_VARIABLE] = "aot_eager"
    return check_first_step(rank, world_size, config)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen2_vl", "llava"])
def test_check_passes_with_compiled_decoder_blocks_and_recompute(shapes, tmp_path, arch):
    model = save_tiny_vision_model(tmp_path / "model", arch)
    config = vision_config(model, shapes, tmp_path, compile=True, recompute="full")
    report = run_distributed(config.world_size, compiled_check, config)[0]
    assert report["mismatched"] == [] and report["passed"], report


def test_the_image_processor_loads_where_the_package_exports_a_stand_in(vision_model,
                                                                        monkeypatch):
    """transformers 5.17 without torchvision (the GPU machine's) exports, as
    ``transformers.AutoImageProcessor``, a stand-in that refuses to load; the class in its
    own module picks the Pillow processor, and that is the one meshpipe loads."""
    import transformers

    from meshpipe.models import hf
    from meshpipe.train.data.images import ImageInputs
    from meshpipe.train.data.tokenizers import HFTokenizer

    class StandIn:
        @classmethod
        def from_pretrained(cls, *args, **kwargs):
            raise ImportError("AutoImageProcessor requires the Torchvision library")

    monkeypatch.setattr(transformers, "AutoImageProcessor", StandIn)
    info = hf.inspect_model(vision_model)
    inputs = ImageInputs(vision_model, info.vision, HFTokenizer(vision_model))
    assert type(inputs._processor).__name__.endswith("Pil")


def test_rows_without_images_rotate_by_their_positions_in_all_three_sections(tmp_path):
    """Qwen2-VL's decoder rotates by 3D positions. A row without images (text-only data)
    has none from the batcher; its token positions go to the rotary embedding in each of
    the three sections, as transformers 5.24 expands them itself and 5.17 (the GPU
    machine's) needs them."""
    from meshpipe.context import LocalAttention
    from meshpipe.models import hf, hf_vision

    model = save_tiny_vision_model(tmp_path, "qwen2_vl")
    skeleton = hf.build_skeleton(model)
    (chunk,) = hf_vision.split_vision_model(
        skeleton, hf.split_model(skeleton, [skeleton.config.text_config.num_hidden_layers],
                                 LocalAttention()), image_token_id=-1)
    hf.materialize(skeleton, [chunk], model)
    given = []
    rotary = chunk.decoder.rotary_emb
    rotate = rotary.forward
    rotary.forward = lambda hidden, ids: given.append(ids) or rotate(hidden, ids)
    chunk(torch.randint(0, 50, (2, 8)))
    (ids,) = given
    assert ids.shape == (3, 2, 8)
    assert torch.equal(ids, torch.arange(8).expand(3, 2, 8))


def test_a_chat_template_kept_by_the_processor_renders_the_chats(vision_model, tmp_path):
    """Hub vision-language directories keep the chat template in the processor's
    chat_template.json: the tokenizer then renders with it."""
    from meshpipe.train.data.tokenizers import HFTokenizer

    copy = tmp_path / "model"
    copy.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (copy / name).write_bytes((vision_model / name).read_bytes())
    template = (vision_model / "chat_template.jinja").read_text()
    assert not HFTokenizer(copy).has_chat_template
    (copy / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes"}]
    assert HFTokenizer(copy).render_chat(chat) == HFTokenizer(vision_model).render_chat(chat)


@pytest.mark.slow
@pytest.mark.distributed
def test_a_resumed_run_ends_where_the_uninterrupted_one_does(shapes, tmp_path):
    """The images of each step come back in the same order after a resume: the losses of
    the steps after the checkpoint equal the uninterrupted run's, exactly."""
    from trainer_cases import train

    model = save_tiny_vision_model(tmp_path / "model", "qwen2_vl")
    config = vision_config(model, shapes, tmp_path / "whole", steps=4, checkpoint_every=2,
                           pack=True)
    whole = run_distributed(config.world_size, train, config)[0]
    step_2 = sorted((tmp_path / "whole" / "checkpoint").glob("*step-000002"))[0].name
    again = run_distributed(config.world_size, train, config, rewind_to=step_2)[0]
    assert again[2:] == whole[2:]


def chats_of(captions, path):
    """The captions as conversations: the user shows the pictures and asks, the assistant
    answers with the caption."""
    rows = []
    for line in captions.read_text().splitlines():
        row = json.loads(line)
        shown = [{"type": "image", "image": name} for name in row["images"]]
        rows.append({"messages": [
            {"role": "user", "content": [*shown, {"type": "text", "text": "what is shown?"}]},
            {"role": "assistant", "content": row["text"]}]})
    return write_rows(path, rows)


def as_datasets_keeps_them(captions, chats):
    """The captions and chats of ``chats_of`` as a datasets user has them: each image's
    encoded bytes in an ``images`` column (datasets' Image), a chat's image parts
    ``{"type": "image"}`` only, every message's content a list of parts."""
    folder = captions.parent
    rows = []
    for line in captions.read_text().splitlines():
        row = json.loads(line)
        encoded = [{"bytes": (folder / name).read_bytes(), "path": None}
                   for name in row["images"]]
        rows.append((encoded, row["text"]))
    caption_rows = [{"images": encoded, "text": text} for encoded, text in rows]
    chat_rows = [{"images": encoded, "messages": [
        {"role": "user", "content": [*[{"type": "image"}] * len(encoded),
                                     {"type": "text", "text": "what is shown?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": text}]}]}
        for encoded, text in rows]
    assert len(rows) == len(chats.read_text().splitlines())
    return {"captions": caption_rows, "chats": chat_rows}


def same_images_and_tokens(left, right):
    return (np.array_equal(left.tokens, right.tokens)
            and np.array_equal(left.offsets, right.offsets)
            and np.array_equal(np.asarray(left.mask), np.asarray(right.mask))
            and all(np.array_equal(getattr(left.images, name), getattr(right.images, name))
                    for name in ("pixels", "grids", "image_offsets")))


@pytest.mark.parametrize("kind", ["captions", "chats"])
def test_images_in_parquet_and_save_to_disk_columns_give_the_jsonl_cache(shapes, tmp_path,
                                                                         kind):
    """The same captions or chats with their images as bytes in datasets' Image column,
    written by datasets as Parquet and by save_to_disk (image parts without a file take the
    row's images in turn): the tokens, targets and image patches of the jsonl rows whose
    images are files."""
    datasets = pytest.importorskip("datasets")
    pytest.importorskip("pyarrow")
    model = save_tiny_vision_model(tmp_path / "model", "qwen2_vl")
    chats = chats_of(shapes, shapes.parent / "chats-as-jsonl.jsonl")
    jsonl = {"captions": shapes, "chats": chats}[kind]
    rows = as_datasets_keeps_them(shapes, chats)[kind]
    table = datasets.Dataset.from_list(rows).cast_column(
        "images", datasets.List(datasets.Image()))
    assert table.features["images"].feature.decode and "bytes" in str(table.data.schema)
    table.to_parquet(str(tmp_path / f"{kind}.parquet"), batch_size=7)
    table.save_to_disk(str(tmp_path / "saved"), num_shards=2)
    config = vision_config(model, jsonl, tmp_path)
    expected = data_sources.tokenized(config, str(jsonl))
    assert expected.images is not None and len(expected.images.grids) > 20
    for path in (tmp_path / f"{kind}.parquet", tmp_path / "saved"):
        assert same_images_and_tokens(expected, data_sources.tokenized(config, str(path)))


def a_mixture(shapes, folder):
    """Three --data sources: the captions, the same pictures asked about in chats (as
    Parquet, datasets' layout) and plain text without images."""
    datasets = pytest.importorskip("datasets")
    chats = chats_of(shapes, shapes.parent / "chats-for-a-mixture.jsonl")
    rows = as_datasets_keeps_them(shapes, chats)["chats"]
    datasets.Dataset.from_list(rows).cast_column(
        "images", datasets.List(datasets.Image())).to_parquet(str(folder / "chats.parquet"))
    text = write_rows(folder / "text.jsonl", [
        {"text": "the circle is red and the square is blue. " * (1 + index % 4)}
        for index in range(30)])
    return (f"{shapes}:0.5", f"{folder / 'chats.parquet'}:0.3", f"{text}:0.2")


@pytest.mark.parametrize("pack", [False, True], ids=["unpacked", "packed"])
def test_a_mixture_with_and_without_images_gives_every_sequence_its_pictures(shapes, tmp_path,
                                                                              pack):
    """Each sequence of a mixture's batch has its own source's pictures (a source without
    images: none, of the images' width) and length, and its targets their source; the tower's
    cost counts each source's patches per token in its weight's share."""
    from meshpipe.train.loop.batches import RankBatches

    model = save_tiny_vision_model(tmp_path / "model", "qwen2_vl")
    config = vision_config(model, a_mixture(shapes, tmp_path), tmp_path, pp=1,
                           microbatch_size=4, pack=pack, seq_len=256)
    sources.check_sources(config)
    mixture = data_sources.samplers(config, 0)[0]
    batch = mixture.batch(0)
    assert set(batch.sources) == {0, 1, 2} and len(batch.pictures) == len(batch.lengths) == 8
    assert pack or max(batch.lengths) < config.seq_len  # microbatches cut to their rows
    chosen, within = mixture.assignment(range(8))
    for row, (source, number) in enumerate(zip(chosen, within)):
        alone = mixture.samplers[source].sequences([int(number)])
        assert batch.lengths[row] == alone.lengths[0]
        pieces, expected = batch.pictures[row], alone.pictures[0]
        assert len(pieces) == len(expected)
        assert all(torch.equal(a.pixels, b.pixels) and torch.equal(a.grids, b.grids)
                   for a, b in zip(pieces, expected))
        if source == 2:
            assert all(piece.pixels.shape == (0, pieces[0].pixels.shape[1]) for piece in pieces)
    assert any(len(piece.grids) for row in batch.pictures for piece in row)
    microbatches = RankBatches(config, 0, 0, torch.device("cpu"))(mixture, 0)
    for targets in microbatches.targets:
        assert targets.sources.shape == targets.ids.shape
    captions_alone = sources.tower_cost(vision_config(model, shapes, tmp_path))
    assert sources.tower_cost(config) == pytest.approx(
        captions_alone * 0.5 + sources.tower_cost(vision_config(
            model, tmp_path / "chats.parquet", tmp_path)) * 0.3)


@pytest.mark.distributed
@pytest.mark.parametrize("pack", [False, True], ids=["unpacked", "packed"])
def test_check_passes_on_a_mixture_with_and_without_images(shapes, tmp_path, pack):
    model = save_tiny_vision_model(tmp_path / "model", "qwen2_vl")
    config = vision_config(model, a_mixture(shapes, tmp_path), tmp_path, pack=pack)
    report = run_distributed(config.world_size, check_first_step, config)[0]
    assert report["mismatched"] == [] and report["passed"], report


@pytest.mark.distributed
@pytest.mark.parametrize("arch", ["qwen2_vl", "llava"])
def test_check_passes_on_chats_with_images_and_the_loss_on_the_answers(shapes, tmp_path, arch):
    model = save_tiny_vision_model(tmp_path / "model", arch)
    chats = chats_of(shapes, shapes.parent / f"chats-{arch}.jsonl")
    config = vision_config(model, chats, tmp_path, pack=True)
    report = run_distributed(config.world_size, check_first_step, config)[0]
    assert report["mismatched"] == [] and report["passed"], report


def test_parts_of_a_model_that_has_none_are_refused_in_one_line(tmp_path, shapes):
    from hf_models import save_tiny_model, save_tiny_tokenizer

    decoder = save_tiny_model(tmp_path / "decoder", "qwen2", vocab_size=320)
    save_tiny_tokenizer(decoder)
    config = TrainConfig(**{**for_a_model(VISION), "model": str(decoder), "freeze": "vision",
                            "out_dir": str(tmp_path)})
    with pytest.raises(ValueError, match="--freeze name parts of a vision-language model"):
        sources.check_sources(config)
    with pytest.raises(ValueError, match="not a part of a vision-language model"):
        TrainConfig(freeze="tower")
    with pytest.raises(ValueError, match="with a positive scale"):
        TrainConfig(lr_scale="vision=0")
    model = save_tiny_vision_model(tmp_path / "model", "qwen2_vl")
    with pytest.raises(ValueError, match="leaves nothing to train"):
        sources.check_sources(vision_config(model, shapes, tmp_path,
                                            freeze="vision,projector,language"))


@pytest.mark.distributed
def test_a_replica_without_images_still_joins_the_towers_reduction(shapes, tmp_path):
    """Data parallelism where, at the checked step, one replica's microbatches show images
    and the other's none: the tower's gradients (from one replica) are averaged over both,
    no hang, and --check holds."""
    captions = [json.loads(line) for line in shapes.read_text().splitlines()]
    rows = [row if index % 8 == 0 else {"text": row["text"]} for index, row in
            enumerate(row for row in captions if row["images"])]
    data = write_rows(shapes.parent / "few-images.jsonl", rows)
    model = save_tiny_vision_model(tmp_path / "model", "qwen2_vl")

    def shown(config, dp_rank):
        batch = data_sources.samplers(config, dp_rank)[0].batch(0)
        return sum(len(piece.grids) for row in batch.pictures for piece in row)

    for seed in range(50):
        config = vision_config(model, data, tmp_path, dp=2, seed=seed)
        sources.check_sources(config)
        if shown(config, 0) > 0 and shown(config, 1) == 0:
            break
    else:
        pytest.fail("no seed gives one replica images and the other none")
    report = run_distributed(config.world_size, check_first_step, config)[0]
    assert report["mismatched"] == [] and report["passed"], report
