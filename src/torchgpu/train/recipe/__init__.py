"""What a training recipe chooses besides the model, the data and the schedule: the optimizer
(``optimizers``: fused or foreach per device, a user's factory untouched) and ``--compile``
(``compiling``). The evaluation metrics stay at ``torchgpu.train.metrics``, a public path.
"""
