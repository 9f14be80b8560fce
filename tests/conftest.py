"""Shared fixtures and markers. Tests run on CPU; multi-process tests use gloo."""
