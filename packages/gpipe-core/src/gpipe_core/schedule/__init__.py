"""Schedules as data: actions and their kinds (:mod:`._action`), placement
(:mod:`._placement`), checking and the clock (:mod:`._check`), simulation
(:mod:`._simulate`), lists generated in unit time (:mod:`._generate`), and the built-in
schedules with their registry (:mod:`._schedules`).

Private to gpipe-core: its public names are imported from ``gpipe_core``.
"""
