"""Memory: the model of what each strategy holds per rank, and the meter that counts what it does hold."""

from scale_ocr.memory.meter import StateBytes, StateMeter, count_state
from scale_ocr.memory.model import Prediction, StateLayout, deepspeed_estimate, ideal_model_state, predict

__all__ = ["Prediction", "StateBytes", "StateLayout", "StateMeter", "count_state", "deepspeed_estimate",
           "ideal_model_state", "predict"]
