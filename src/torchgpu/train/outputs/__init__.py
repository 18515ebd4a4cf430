"""The files a run writes under ``--out`` and what goes in them: the file layout and
writers (:mod:`.files`: every entry in ``RUN_ENTRIES``), whether ``--out`` can hold the
run (:mod:`.out_dir`), the evaluation each epoch ends with (:mod:`.evaluation`), step
records within an epoch (:mod:`.step_log`), the loss plot (:mod:`.loss_plot`) and the
run's result and summary (:mod:`.report`).
"""
