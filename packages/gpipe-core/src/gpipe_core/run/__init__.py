"""Running a schedule: the runner, its workers and threads, each partition's forward and backward.

Private to gpipe-core: its public names are imported from ``gpipe_core``.
"""
