"""helios: serves Flare core bundles."""

__version__ = "0.1.0"
