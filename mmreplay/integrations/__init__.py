"""Integrations with other libraries; each module imports its optional dependency itself."""
