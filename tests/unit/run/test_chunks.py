"""The chunk scheduler (`--sink_size`): where chunks end, their tails, and K's resolution. Pure."""
import pytest

from msdist.base.errors import ConfigError
from msdist.run import chunks
from msdist.run.chunks import Limits


def _epoch(global_step, step, steps_per_epoch, k, **limits):
    return list(chunks.epoch_lengths(global_step, step, steps_per_epoch, k, Limits(**limits)))


def test_full_chunks_then_the_epoch_end_tail():
    assert _epoch(0, 0, 20, 8) == [8, 8, 4]
    assert _epoch(20, 0, 20, 8) == [8, 8, 4]   # the next epoch starts at its own step 0


def test_chunks_end_at_log_steps_of_the_epoch():
    # log_every 10 of a 25-step epoch: steps 10, 20 and the epoch end 25 are log steps.
    assert _epoch(0, 0, 25, 8, log_every=10) == [8, 2, 8, 2, 5]
    assert _epoch(0, 0, 25, 10, log_every=10) == [10, 10, 5]


def test_chunks_end_at_saves_by_steps_counted_in_global_steps():
    # Epoch 2 (global steps 20..40) with saves every 15 global steps: 30 is a boundary, mid-epoch.
    assert _epoch(20, 0, 20, 8, save_every_steps=15) == [8, 2, 8, 2]


def test_max_steps_tail_and_nothing_past_it():
    assert _epoch(0, 0, 20, 8, max_steps=12) == [8, 4]
    assert _epoch(12, 12, 20, 8, max_steps=12) == []


def test_chunks_end_at_the_profiler_windows_edges():
    # --profile_steps 5:11: the window's steps 5..11 are whole chunks, on every rank alike.
    assert _epoch(0, 0, 20, 8, ends=(4, 11)) == [4, 7, 8, 1]


def test_a_resumed_run_mid_chunk_reaches_the_same_boundaries():
    # Stopped at global step 5 of a K=8, log_every 10 run: it continues 5 to 10, then as the uninterrupted run did.
    uninterrupted = _epoch(0, 0, 25, 8, log_every=10)
    resumed = _epoch(5, 5, 25, 8, log_every=10)
    assert resumed == [5, 8, 2, 5]
    ends = lambda start, lengths: {start + sum(lengths[:i + 1]) for i in range(len(lengths))}
    # The first chunk ends at the next log step; from there on the chunks are the uninterrupted run's.
    assert ends(5, resumed) == {e for e in ends(0, uninterrupted) if e >= 10}


def test_an_agreed_stop_lands_on_the_first_chunk_end_at_or_after_the_check_step():
    # The stop agreement is asked after each chunk; its collective runs once global_step >= check_step.
    check_step, at = 11, 0
    for length in chunks.epoch_lengths(0, 0, 40, 8, Limits()):
        at += length
        if at >= check_step:
            break
    assert at == 16


def test_segments_sink_the_full_chunks_and_feed_the_tails_from_the_host():
    assert chunks.segments([8, 8, 4], 8, sinks=True) == [(True, [8, 8]), (False, [4])]
    assert chunks.segments([5, 8, 2, 8, 8, 1], 8, sinks=True) == \
        [(False, [5]), (True, [8]), (False, [2]), (True, [8, 8]), (False, [1])]
    assert chunks.segments([8, 8, 4], 8, sinks=False) == [(False, [8, 8, 4])]   # CPU: one host-fed epoch
    assert chunks.segments([], 8, sinks=True) == chunks.segments([], 8, sinks=False) == []


def test_auto_is_the_largest_divisor_of_the_boundaries_up_to_the_cap():
    assert chunks.auto_size(10, 0, 64) == 10
    assert chunks.auto_size(100, 0, 64) == 50
    assert chunks.auto_size(20, 30, 64) == 10
    assert chunks.auto_size(7, 0, 64) == 7


def test_resolve_size_per_device():
    assert chunks.resolve_size("auto", "CPU", False, 10, 0) == 1       # no data sink on CPU
    assert chunks.resolve_size("auto", "GPU", False, 20, 0) == 20
    assert chunks.resolve_size(8, "CPU", False, 10, 0) == 8
    assert chunks.resolve_size(8, "GPU", True, 10, 0) == 1            # several slots: BatchNorm swapped from the host


def test_parse_and_check_size():
    assert chunks.parse_size("8") == 8
    assert chunks.parse_size(" AUTO ") == "auto"
    chunks.check_size(8)
    chunks.check_size("auto")
    for bad in (0, -3, "fast"):
        with pytest.raises(ConfigError, match="--sink_size"):
            chunks.check_size(chunks.parse_size(bad))


def test_describe_says_how_a_chunk_runs():
    assert chunks.describe(10, True, False) == "sink_size 10: chunks of up to 10 steps, each one sunk call (GPU)"
    assert "one host call per step" in chunks.describe(8, False, False)
    assert "several batch slots" in chunks.describe(1, False, True)


def _loop_sunk_chunks(global_step, steps_per_epoch, epochs, k, limits):
    """The sunk chunks the trainer's loop runs (`Trainer._train_epoch`: each epoch's `epoch_lengths` cut into
    `segments`), as (epoch, step of the epoch, length), in order."""
    sunk_chunks = []
    while global_step < epochs * steps_per_epoch:
        epoch, step = divmod(global_step, steps_per_epoch)
        lengths = list(chunks.epoch_lengths(global_step, step, steps_per_epoch, k, limits))
        for sunk, part in chunks.segments(lengths, k, sinks=True):
            for length in part:
                if sunk:
                    sunk_chunks.append((epoch, step, length))
                global_step, step = global_step + length, step + length
        if step < steps_per_epoch:
            break
    return sunk_chunks


def _expand(spans, k):
    return [(epoch, first + i, k) for epoch, first, steps in spans for i in range(0, steps, k)]


RUNS = [  # (resumed at global step, steps per epoch, epochs, K, Limits)
    (0, 20, 3, 8, Limits()),
    (0, 25, 4, 8, Limits(log_every=10)),
    (5, 25, 3, 8, Limits(log_every=10)),                     # resumed mid-chunk
    (27, 12, 5, 4, Limits(log_every=6, save_every_steps=10, max_steps=50)),
    (3, 7, 6, 3, Limits(max_steps=31, ends=(9, 16))),         # the profiler window's edges
    (0, 100, 90, 10, Limits(log_every=10, save_every_steps=500)),
    (0, 5, 2, 8, Limits()),                                  # K longer than an epoch: nothing sunk
]


@pytest.mark.parametrize("run", RUNS)
def test_the_runs_sunk_spans_are_every_sunk_chunk_the_loop_runs_in_order(run):
    """One sunk dataset and one sunk network per run: the spans hold exactly the loop's sunk chunks, across epochs, in
    the order it runs them (an agreed stop runs a prefix of them)."""
    at, steps_per_epoch, epochs, k, limits = run
    spans = chunks.sunk_spans(chunks.run_chunks(at, steps_per_epoch, epochs, k, limits), k)
    assert _expand(spans, k) == _loop_sunk_chunks(at, steps_per_epoch, epochs, k, limits)
    # Spans are maximal: two in a row are never contiguous steps of one epoch.
    assert all(a[0] != b[0] or a[1] + a[2] != b[1] for a, b in zip(spans, spans[1:]))


def test_run_chunks_cover_the_run_from_the_resume_point_to_its_end():
    run = list(chunks.run_chunks(5, 25, 3, 8, Limits(log_every=10)))
    assert run[:4] == [(0, 5, 5), (0, 10, 8), (0, 18, 2), (0, 20, 5)]
    assert sum(length for _, _, length in run) == 3 * 25 - 5
    assert sum(length for _, _, length in chunks.run_chunks(0, 20, 3, 8, Limits(max_steps=45))) == 45


def test_sunk_spans_merge_consecutive_full_chunks_of_an_epoch_only():
    run = chunks.run_chunks(0, 20, 3, 8, Limits(max_steps=45))   # 8 8 4 | 8 8 4 | 5
    assert chunks.sunk_spans(run, 8) == [(0, 0, 16), (1, 0, 16)]
    run = chunks.run_chunks(0, 25, 2, 8, Limits(log_every=10))   # 8 2 8 2 5 per epoch
    assert chunks.sunk_spans(run, 8) == [(0, 0, 8), (0, 10, 8), (1, 0, 8), (1, 10, 8)]


def test_with_a_step_time_auto_makes_chunks_of_half_a_second_to_a_second():
    # A100 AMP ResNet-50, 32 images of 100 px: 2.7 ms a step; V100 FP32 at 224 px, 128 images: 0.35 s.
    assert chunks.timed_size(0.0027, 10, 0) == (186, 186)       # the step line at a chunk's end
    assert chunks.timed_size(0.35, 10, 0) == (2, 10)
    assert chunks.timed_size(0.03, 10, 0) == (17, 17)
    assert chunks.timed_size(0.03, 10, 100) == (20, 20)          # saves by steps cut no chunk: a divisor of 100
    assert chunks.timed_size(0.001, 10, 50) == (50, 50)          # the save period bounds it
    assert chunks.timed_size(1e-5, 10, 0) == (chunks.TIMED_CAP, chunks.TIMED_CAP)
    assert chunks.timed_size(2.0, 10, 0) == (1, 10)              # a step longer than a chunk: one step a call
    for step_s in (0.0027, 0.01, 0.03, 0.1, 0.35):
        k, _ = chunks.timed_size(step_s, 10, 0)
        assert 0.5 <= k * step_s < 1.0


def test_every_rank_takes_the_slowest_ranks_chunk_and_without_every_forecast_the_options():
    assert chunks.agreed_size([0.0027, 0.0054], 10, 10, 0) == (93, 93)
    assert chunks.agreed_size([0.0054, 0.0027], 10, 10, 0) == (93, 93)   # the same on each rank, whatever its own
    assert chunks.agreed_size([0.0027, 0.0], 10, 10, 0) == (10, 10)      # a GPU without figures: K from the options
    assert chunks.agreed_size([0.0027], 10, 10, 0) == (186, 186)
