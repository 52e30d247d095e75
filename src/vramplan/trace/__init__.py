"""Fake-tensor tracing of training steps: what was allocated, when, by whom, and what it is."""
