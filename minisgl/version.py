__version__ = "0.1.0"  # NOTE: keep equal to pyproject.toml's
