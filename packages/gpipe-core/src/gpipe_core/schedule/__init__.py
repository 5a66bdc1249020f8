"""Schedules as data: actions and their kinds (``_action``), placement
(``_placement``), checking and the clock (``_check``), simulation
(``_simulate``), lists generated in unit time (``_generate``), and the built-in
schedules with their registry (``_schedules``).

Private to gpipe-core: its public names are imported from ``gpipe_core``.
"""
