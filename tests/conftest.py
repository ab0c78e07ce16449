"""Shared fixtures: a tiny randomly initialised open_clip model and a generated image folder."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import open_clip
import pytest
import torch
from PIL import Image

from tests.towers import TOWERS, Tower, build_tower

TINY_CLIP_NAME = "frolic-tiny-vit"
TINY_CLIP_CONFIG: dict[str, Any] = {
    "embed_dim": 32,
    "vision_cfg": {"image_size": 32, "patch_size": 8, "width": 64, "layers": 2, "head_width": 32},
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 64, "heads": 2, "layers": 2},
}
IMAGE_FOLDER_CLASSES = ("red_square", "green_circle", "blue_stripes")
IMAGES_PER_CLASS = 7


@dataclass(frozen=True)
class TinyClip:
    """A tiny open_clip architecture registered with open_clip, and random weights for it.

    ``open_clip.create_model_and_transforms(model_name, pretrained=str(checkpoint_path))`` and
    ``open_clip.get_tokenizer(model_name)`` work offline.
    """

    model_name: str
    config_path: Path
    checkpoint_path: Path


@pytest.fixture(scope="session")
def tiny_clip(tmp_path_factory: pytest.TempPathFactory) -> TinyClip:
    """Register a tiny ViT CLIP config (embed_dim 32, 32px images) and save seeded weights.

    Its ``logit_scale`` is OpenAI CLIP's, ln 100, so the model's tau_c is the paper's 0.01.
    """
    folder = tmp_path_factory.mktemp("tiny_clip")
    config_path = folder / f"{TINY_CLIP_NAME}.json"  # open_clip registers configs by file stem
    config_path.write_text(json.dumps(TINY_CLIP_CONFIG, indent=2))
    open_clip.add_model_config(config_path)
    torch.manual_seed(0)
    model = open_clip.create_model(TINY_CLIP_NAME)
    with torch.no_grad():
        model.logit_scale.fill_(math.log(100.0))
    checkpoint_path = folder / "tiny_clip.pt"
    torch.save(model.state_dict(), checkpoint_path)
    return TinyClip(TINY_CLIP_NAME, config_path, checkpoint_path)


@pytest.fixture(scope="session")
def tiny_clip_loaded(tiny_clip: TinyClip) -> tuple[torch.nn.Module, Any, Any]:
    """``(model, eval preprocess, tokenizer)`` of :func:`tiny_clip`, loaded once, in eval mode."""
    model, _, preprocess = open_clip.create_model_and_transforms(
        tiny_clip.model_name, pretrained=str(tiny_clip.checkpoint_path)
    )
    model.eval()
    return model, preprocess, open_clip.get_tokenizer(tiny_clip.model_name)


@pytest.fixture(scope="session")
def tiny_towers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Tower]:
    """One tiny model per tower type of the other open_clip families (see tests/towers.py)."""
    folder = tmp_path_factory.mktemp("tiny_towers")
    return {name: build_tower(folder, name) for name in TOWERS}


def _pattern_image(rng: np.random.Generator, kind: int, size: int = 40) -> Image.Image:
    """A 40x40 RGB image: noisy base colour per class plus a class-specific shape."""
    base = np.zeros((size, size, 3), dtype=np.float64)
    base[..., kind] = 160.0
    image = base + rng.normal(0.0, 25.0, size=base.shape)
    yy, xx = np.mgrid[:size, :size]
    if kind == 0:
        mask = (abs(yy - size / 2) < size / 4) & (abs(xx - size / 2) < size / 4)
    elif kind == 1:
        mask = (yy - size / 2) ** 2 + (xx - size / 2) ** 2 < (size / 3) ** 2
    else:
        mask = (xx // 5) % 2 == 0
    image[mask] += rng.uniform(40.0, 90.0, size=3)
    return Image.fromarray(np.clip(image, 0, 255).astype(np.uint8))


@pytest.fixture(scope="session")
def image_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An ImageFolder layout: 3 class sub-folders x 7 seeded 40x40 RGB PNGs (+ a stray .txt)."""
    root = tmp_path_factory.mktemp("image_folder")
    rng = np.random.default_rng(0)
    for kind, name in enumerate(IMAGE_FOLDER_CLASSES):
        (root / name).mkdir()
        for i in range(IMAGES_PER_CLASS):
            _pattern_image(rng, kind).save(root / name / f"img_{i:02d}.png")
    (root / "notes.txt").write_text("not an image\n")
    return root


SLOW = {
    # over ~9 s each on 2 shared CPU cores (pytest --durations): processes, DDP, InMaP's 2,000
    # steps, pre-training; `pytest -m "not slow"` leaves them out, CI runs everything
    "tests/test_inmap.py::test_proxies_match_the_reference_code_at_its_defaults",
    "tests/test_inmap.py::test_two_uneven_shards_equal_one",
    "tests/test_inmap.py::test_sharded_frolic_on_inmap_equals_whole",
    "tests/test_inmap.py::test_command_line_runs_frolic_on_inmap",
    "tests/test_inmap.py::test_proxies_beat_the_text_prototypes_and_frolic_adds_to_them",
    "tests/test_inmap.py::test_fit_recomputes_the_sums_with_the_proxies",
    "tests/test_sweep.py::test_sweep_of_ddp_runs_through_the_cli",
    "tests/test_cli.py::test_report_files",
    "tests/test_cli.py::test_a_successful_ddp_run_is_quiet",
    "tests/test_cli.py::test_one_and_two_devices_agree",
    "tests/test_cli.py::test_missing_checkpoint_is_one_clear_error_without_traceback",
    "tests/test_cli.py::test_head_file_scores_new_images_without_adapting",
    "tests/test_cli.py::test_limited_smoke_runs_adapt_on_what_they_saw",
    "tests/test_bad_samples.py::test_two_processes_count_skipped_samples_like_one",
    "tests/test_bad_samples.py::test_corrupt_file_and_nan_sample_end_to_end",
    "tests/test_module.py::test_two_process_ddp_equals_single_process",
    "tests/test_module.py::test_padding_distributed_sampler_is_detected",
    "tests/test_module.py::test_features_and_prototypes_match_an_independent_encode",
    "tests/test_store.py::test_store_written_by_two_processes_is_read_by_one",
    "tests/test_metrics.py::test_two_process_gloo_group_equals_one_process",
    "tests/test_sharded_core.py::test_two_process_gloo_group_equals_whole",
    "tests/test_label_shift.py::test_few_samples_per_class_keep_the_balanced_default",
    "tests/test_demo.py::test_demo_trains_caches_adapts_and_writes_the_usual_outputs",
    "tests/test_demo.py::test_a_successful_demo_run_is_quiet",
    "tests/test_demo.py::test_the_second_demo_run_reads_the_cache",
    "tests/test_descriptions.py::test_offline_is_one_sentence_and_exit_status_2",
    "tests/test_splits.py::test_metrics_json_and_table_name_the_split",
    "tests/test_readme.py::test_snippet_runs",
    "tests/test_reuse_cli.py::test_ddp_error_of_one_rank_is_one_line_and_exit_2",
    "tests/test_shard_errors.py::test_a_real_two_process_group_raises_on_both_ranks",
    "tests/test_sweep_files.py::test_a_run_stops_with_the_sweep",
    "tests/test_test_prior.py::test_real_ddp_processes_give_the_single_process_result",
    "tests/test_test_prior.py::test_chunk_size_threads_and_no_logit_buffer_do_not_change_the_result",
    "tests/test_test_prior.py::test_mixture_weights_match_a_float64_reference_and_recover_known_weights",
    "tests/test_label_shift.py::test_label_shift_does_no_harm_and_nears_the_known_prior",
    "tests/test_adaptation.py::test_transformers_clip_module_1_and_2_processes_equal_fit_frolic",
    "tests/test_adaptation.py::test_online_answers_and_feature_store_work_with_a_module_of_ones_own",
    "tests/test_class_names.py::test_the_issue_case_scores_against_the_true_classes",
    "tests/test_cross_fit.py::test_the_default_passes_inmap_balanced_to_its_test_prior",
}
"""Tests marked ``slow`` (their node id without parameters)."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the tests of :data:`SLOW` with ``pytest.mark.slow``."""
    for item in items:
        if item.nodeid.split("[")[0] in SLOW:
            item.add_marker(pytest.mark.slow)
