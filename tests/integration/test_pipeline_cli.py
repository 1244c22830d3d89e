"""The data pipeline as real processes: `python -m msdist.data bench` and training with soft labels."""
import math
import re

import pytest

from conftest import run_msdist, tiny_args


@pytest.mark.multiprocess
def test_bench_cli_reports_start_up_steady_rate_stage_cpu_and_cores(data_dir):
    """`msdist.data bench --native`: header, CPU per stage, the cores advice, native's line, then msdist's
    start-up, its steady img/s and, last, what a step sends to the device."""
    proc = run_msdist("data", ["bench", data_dir, "--image_size", "32", "--epochs", "2", "--batch_size", "16",
                               "--native", "--stage_images", "64", "--gpu_rate", "20000"], timeout=240)
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 7, proc.stdout
    assert re.fullmatch(r"bench of \S+/Training: 192 images, workers 1, image_size 32, augment true, batch 16, "
                        r"2 epoch\(s\)", lines[0]), lines[0]
    stages = re.fullmatch(r"CPU per image \(1 worker, 64 images\): read\+decode (\d+) us, resize (\d+) us, "
                          r"augment (\d+) us, batch (\d+) us; total (\d+) us", lines[1])
    assert stages and int(stages[1]) > 0, lines[1]
    assert abs(sum(int(stages[i]) for i in range(1, 5)) - int(stages[5])) <= 2    # each figure rounded
    advice = re.fullmatch(r"one core feeds (\d+) img/s; a GPU training at 20000 img/s needs (\d+) core\(s\) per "
                          r"rank for its input", lines[2])
    assert advice and int(advice[1]) == pytest.approx(1e6 / int(stages[5]), rel=0.02), lines[2]
    assert math.ceil(20000 / int(advice[1]) * 0.98) <= int(advice[2]) <= math.ceil(20000 / int(advice[1]) * 1.02)
    assert re.fullmatch(r"native ImageFolderDataset \+ C\+\+ ops: start-up \d+\.\d\d s, steady \d+ img/s", lines[3])
    assert re.fullmatch(r"start-up: \d+\.\d\d s to the first batch \(later epochs \d+\.\d\d s\)", lines[4])
    # The steady figure is the last img/s printed: 2 epochs of 12 batches, the first of each not counted.
    steady = re.fullmatch(r"msdist training pipeline: (\d+) img/s steady \(352 images after the first batch of "
                          r"each epoch\)", lines[5])
    assert steady and int(steady[1]) > 0, lines[5]
    # augment (pad, crop, flip) leaves integer pixels: uint8 crosses, 16 x 3 x 32 x 32 bytes
    assert lines[6] == "input to the device: uint8 pixels, normalized in the train step's graph: 0.0 MiB per step"


@pytest.mark.multiprocess
def test_training_with_soft_labels_runs(data_dir, tmp_path):
    """Every regularization option through the trainer: float targets compile and train (resume is covered above)."""
    proc = run_msdist("train", tiny_args(data_dir, tmp_path, "--train_crop", "random_resized", "--color_jitter", 0.3,
                                         "--label_smoothing", 0.1, "--mixup", 0.2, "--cutmix", 1.0, "--max_steps", 2))
    assert "eval result:" in proc.stdout
