"""Moving tensors between partitions: in one process and across processes.

Private to gpipe-core: its public names are imported from ``gpipe_core``.
"""
