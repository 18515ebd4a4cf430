"""What a training recipe chooses besides the model, the data and the schedule: the optimizer
(``optimizers``), ``--compile`` (``compiling``) and the evaluation metrics (``metrics``).
"""
