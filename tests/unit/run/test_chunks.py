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
