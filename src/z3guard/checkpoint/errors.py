class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded; the message names the file or field, what was
    expected, what was found, and what to do. Nothing was loaded, nothing older was touched."""
