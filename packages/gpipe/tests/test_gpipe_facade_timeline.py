"""The gpipe.timeline facade re-exports gpipe-core's timeline names as they are."""

from __future__ import annotations

import gpipe.timeline
import gpipe_core


def test_every_name_is_the_same_object() -> None:
    assert gpipe.timeline.__all__ == [
        "PartitionSummary",
        "Phase",
        "TaskEvent",
        "Timeline",
        "TimelineSummary",
        "task_label",
        "theoretical_bubble",
    ]
    for name in gpipe.timeline.__all__:
        assert getattr(gpipe.timeline, name) is getattr(gpipe_core, name), name
