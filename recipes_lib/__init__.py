"""recipes_lib."""
