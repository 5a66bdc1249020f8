"""The gpipe.timeline facade re-exports gpipe-core's timeline names as they are."""

from __future__ import annotations

import os
import subprocess
import sys

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


def test_import_gpipe_gives_gpipe_timeline() -> None:
    # In a fresh interpreter: here gpipe.timeline is already imported by this module.
    code = "import gpipe; print(gpipe.timeline.Timeline.__module__, 'timeline' in gpipe.__all__)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
                            check=False)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["gpipe_core.trace._timeline", "True"]
