"""The adaptive block-size controller: a pure ``decide`` over Prometheus
counters (``decide.py``: the rules; ``cost.py``: step times; ``estimates.py``:
decayed measurements; ``trials.py``: measuring a block in turns with another)."""

from service.controller.decide import ControllerState, Decision, decide
from service.controller.estimates import Estimates, Observation, expected_acceptance_length
from service.controller.settings import ControllerSettings
from service.metric_names import BUCKETS

__all__ = [
    "BUCKETS",
    "ControllerSettings",
    "ControllerState",
    "Decision",
    "Estimates",
    "Observation",
    "decide",
    "expected_acceptance_length",
]
