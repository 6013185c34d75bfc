"""What several commands share; importing this package imports none of it."""
