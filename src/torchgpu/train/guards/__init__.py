"""What keeps a run going, or ends it cleanly, when a step goes wrong: the out-of-memory
back-off (:mod:`.backoff`), ``--batch-size auto`` (:mod:`.auto_batch`), the decisions every
rank takes alike (:mod:`.agreement`: stop, loss, finite gradients) and the bound on a
stop's wait (:mod:`.stop_deadline`).
"""
