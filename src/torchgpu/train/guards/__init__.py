"""What keeps a run's ranks and its stop in step: the decisions every rank takes alike without
a collective per step (``agreement``), the bound on a stop's wait for its step boundary
(``stop_deadline``) and ``--batch-size auto``, agreed by all ranks (``auto_batch``).
"""
