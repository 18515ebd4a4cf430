"""What a training recipe chooses besides the model, the data and the schedule: the
optimizer (:mod:`.optimizers`: fused or foreach per device, a user's factory untouched),
``--compile`` (:mod:`.compiling`) and the evaluation metrics (:mod:`.metrics`).
"""
