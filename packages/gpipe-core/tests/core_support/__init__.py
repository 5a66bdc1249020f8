"""What gpipe-core's tests share: the one way to share a helper between test modules.

The test modules (in the folders that mirror gpipe-core's subpackages) import what they
share from here; ``conftest.py`` holds only fixtures (those that set up and tear down,
such as the test clusters), built from these modules. This package is on the tests' path
through the ``pythonpath`` option of pytest's configuration (the root ``pyproject.toml``).

- :mod:`core_support.models`: the test models (``MODES``, ``Stash``/``Pop``, the U-Net,
  the layer that counts its hooks and retains its gradient, ``Scale``).
- :mod:`core_support.checks`: :func:`~core_support.checks.assert_matches_plain`.
- :mod:`core_support.strategies`: what Hypothesis tests draw from.
- :mod:`core_support.turns`: making a pipeline's runs one turn.
- :mod:`core_support.cluster`: test clusters of rank processes (``Cluster``).
- :mod:`core_support.distributed_cases`: what the ranks of a cluster run (a script, also
  loaded by path: see :func:`core_support.cluster.load_cases`).
- :mod:`core_support.distributed_checks`: the ranks' numbers against the plain model's.
"""
