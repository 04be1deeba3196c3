"""The adaptive block-size controller: a pure ``decide`` over Prometheus
counters (``decide.py``, ``estimates.py``)."""

from service.controller.decide import BUCKETS, ControllerSettings, ControllerState, Decision, decide
from service.controller.estimates import Estimates, Observation, expected_acceptance_length

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
