"""The one owner of every hook into Keras; see docs/architecture.md."""
