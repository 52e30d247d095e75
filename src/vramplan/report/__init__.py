"""Renderers of an Estimate: terminal, JSON (and HTML)."""
