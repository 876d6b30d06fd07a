"""The process layer: the only code that imports loky."""
