"""The single source of tfmp's version (read by setup.cfg)."""

__version__ = "0.1.0"
