"""Tracing a run and the timelines it gives.

Private to gpipe-core: its public names are imported from ``gpipe_core``.
"""
