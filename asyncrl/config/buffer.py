"""The buffer: staleness, admission, reuse, filtering and back-pressure."""

from __future__ import annotations

from pydantic import Field, StrictInt

from asyncrl.config.base import Section
from asyncrl.config.environment import DAY_S, Float


class BufferConfig(Section):
    max_staleness: StrictInt = Field(1, ge=0, le=10_000)
    """k: never train on a trajectory produced more than k versions ago."""
    admission_control: bool = True
    """Hand out prompts only while started samples fit in (V+k+1)*samples_per_step."""
    heartbeat_interval_s: Float = Field(1.0, gt=0.0, le=3600.0)
    """Generators tell the buffer they are alive at least this often."""
    heartbeat_timeout_s: Float = Field(10.0, gt=0.0, le=DAY_S)
    """A generator silent this long is presumed dead: its unfinished groups are requeued."""
    max_reuse: StrictInt = Field(1, ge=1, le=10_000)
    """Serve each sample to the learner at most this many times (while fresh enough)."""
    filter_equal_rewards: bool = False
    """Drop complete groups whose rewards are all equal (DAPO dynamic sampling)."""
    filter_truncated: bool = False
    """Drop a whole group if any of its samples ends with finish_reason `length`."""
    max_held_samples: StrictInt = Field(0, ge=0)
    """Back-pressure: refuse new work while this many samples are ready; 0 means 4 batches."""
    max_held_bytes: StrictInt = Field(256 * 1024 * 1024, ge=1, le=1 << 50)
    """Back-pressure: refuse new work while held samples take this many bytes."""
    stale_retries: StrictInt = Field(2, ge=0, le=100)
    """Times a prompt whose group was evicted as stale is handed out again before its id
    is recorded as skipped."""
