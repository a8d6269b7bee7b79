"""Integrations with other libraries, one module per partner.

Each module imports its optional dependency itself, so `import mmreplay` never does; a
missing extra fails at import of that module with one line naming the extra to install.
"""
