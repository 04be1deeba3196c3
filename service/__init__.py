"""The product around the algorithm: OpenAI API, engines, metrics, controller.

Depends on ``speculative``; never the reverse. Filled in by the service issues.
"""
