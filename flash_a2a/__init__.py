"""Placeholder package: see the project issues; nothing here is implemented yet."""
