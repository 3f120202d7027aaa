"""ignition: compiles checkpoints plus recipes into Flare core bundles."""

__version__ = "0.1.0"
