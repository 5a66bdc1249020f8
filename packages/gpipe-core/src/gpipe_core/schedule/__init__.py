"""Schedules as data: actions, the built-in schedules, checking and simulation.

Private to gpipe-core: its public names are imported from ``gpipe_core``.
"""
