"""The one error type a conversion raises for a bad checkpoint or bad arguments."""


class ConversionError(ValueError):
    """A checkpoint or request that cannot be converted; the message names the culprit."""
