"""The files a run writes under ``--out`` and what goes in them: the layout and writers
(``files``: every entry in ``RUN_ENTRIES``), the evaluation each epoch ends with
(``evaluation``), step records within an epoch (``step_log``), the loss plot
(``loss_plot``), fsdp's final model (``final_model``) and the run's result (``report``).
"""
